"""The parallel block's MLP activation and the packed output projection's input, in one launch.

Contract
--------
`swiglu_cat(attn[..., A], gate[..., F], up[..., F]) -> x[..., A + F]` with
x = cat([attn, silu(gate) * up]), rounded as the eager ops round it: silu in fp32 stored in the
input dtype (what `F.silu` stores), then the product of the two stored values in fp32, stored
in the input dtype (what `*` stores). One row (batch-1 decode); gate and up may be strided
views (column slices of the packed input projection's output): only the last dim must be
contiguous. No host synchronisation: CUDA-graph / device-loop safe.
`swiglu_rows(gate[B, F], up[B, F]) -> silu(gate) * up` for a batched decode step's B rows
(its output projections take attn and the activation apart), rounded the same way.

Why it exists
-------------
The packed o+down projection (packed, int8 and int6 projections) multiplies
[attn, silu(gate) * up] by one weight. Eagerly that input costs three launches per layer
(silu, multiply, concatenate) of a few KB each; at batch 1 their cost is launches and round
trips, about 1.5 us each on the H200 inside a captured step. This kernel writes the packed
input directly: programs [0, A/BLOCK) copy attn, the rest compute the activation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    check_row,
    launch_options,
    next_pow2,
    patch_interpreter_scalars,
    pdl_enabled,
)
from .fp8_rows import MAX_WIDTH, e4m3_row

patch_interpreter_scalars()

BLOCK = 1024


@triton.jit
def _silu_mul(gate_ptrs, up_ptrs, m, dtype: tl.constexpr):
    """silu(gate) * up, rounded as the eager ops round it (see Contract)."""
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up_ptrs, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu stores this
    return (s.to(tl.float32) * u).to(dtype)


@triton.jit
def _swiglu_cat_kernel(
    attn_ptr, gate_ptr, up_ptr, out_ptr, A, F_DIM,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_attn = tl.cdiv(A, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # attn, gate and up come from earlier kernels
    if pid < n_attn:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < A
        tl.store(out_ptr + offs, tl.load(attn_ptr + offs, mask=m), mask=m)
    else:
        offs = (pid - n_attn) * BLOCK + tl.arange(0, BLOCK)
        m = offs < F_DIM
        act = _silu_mul(gate_ptr + offs, up_ptr + offs, m, out_ptr.dtype.element_ty)
        tl.store(out_ptr + A + offs, act, mask=m)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def swiglu_cat_ref(attn: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The eager ops this kernel replaces."""
    return torch.cat([attn, F.silu(gate) * up], dim=-1)


def swiglu_cat(
    attn: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """cat([attn, silu(gate) * up], -1) for one row, in one launch."""
    device = check_device("swiglu_cat", attn, gate, up)
    for name, t in (("attn", attn), ("gate", gate), ("up", up)):
        check_dtype(f"swiglu_cat {name}", t, FLOAT_DTYPES)
        check_row(f"swiglu_cat: {name}", t)
    if not attn.dtype == gate.dtype == up.dtype:
        raise ValueError("swiglu_cat: attn, gate and up must share a dtype")
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_cat: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    a, f = attn.shape[-1], gate.shape[-1]
    out = torch.empty((*attn.shape[:-1], a + f), dtype=attn.dtype, device=device)
    use_pdl = pdl_enabled(launch_pdl, device)
    _swiglu_cat_kernel[(cdiv(a, BLOCK) + cdiv(f, BLOCK),)](
        attn, gate, up, out, a, f,
        BLOCK=BLOCK, USE_PDL=use_pdl, **launch_options(use_pdl, 4),
    )  # fmt: skip
    return out


@triton.jit
def _swiglu_rows_kernel(
    gate_ptr, up_ptr, out_ptr, F_DIM, stride_g, stride_u, stride_o, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < F_DIM
    act = _silu_mul(gate_ptr + row * stride_g + offs, up_ptr + row * stride_u + offs, m,
                    out_ptr.dtype.element_ty)  # fmt: skip
    tl.store(out_ptr + row * stride_o + offs, act, mask=m)


def _gate_up_rows(name: str, gate: torch.Tensor, up: torch.Tensor) -> tuple[int, int]:
    """(B, F) of gate and up, checked: [B, F] each, one shape and dtype, contiguous last dim."""
    check_device(name, gate, up)
    for which, t in (("gate", gate), ("up", up)):
        check_dtype(f"{name} {which}", t, FLOAT_DTYPES)
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"{name}: {which} must be [B, F] with a contiguous last dim")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"{name}: gate {tuple(gate.shape)} {gate.dtype} and up "
            f"{tuple(up.shape)} {up.dtype} differ"
        )
    return gate.shape[0], gate.shape[1]


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for B rows [B, F] (strided rows: column slices of a batched packed
    projection's output), in one launch: what a batched decode step's MLP multiplies by
    down_proj."""
    b, f = _gate_up_rows("swiglu_rows", gate, up)
    out = torch.empty((b, f), dtype=gate.dtype, device=gate.device)
    _swiglu_rows_kernel[(cdiv(f, BLOCK), b)](
        gate, up, out, f, gate.stride(0), up.stride(0), out.stride(0),
        BLOCK=BLOCK, **launch_options(False, 4),
    )  # fmt: skip
    return out


@triton.jit
def _swiglu_rows_fp8_kernel(
    gate_ptr, up_ptr, q_ptr, scale_ptr, F_DIM, stride_g, stride_u, stride_q,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < F_DIM
    act = _silu_mul(gate_ptr + row * stride_g + offs, up_ptr + row * stride_u + offs, m,
                    gate_ptr.dtype.element_ty)  # fmt: skip
    q, scale = e4m3_row(act.to(tl.float32))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(scale_ptr + row, scale)


def swiglu_rows_fp8(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`swiglu_rows`, each row then quantized as fp8_projections.quantize_rows quantizes
    the activation the model's dtype stores: (e4m3 [B, F], float32 scales [B, 1]) for an
    FP8 down_proj, in one launch (APPROXIMATE by design)."""
    b, f = _gate_up_rows("swiglu_rows_fp8", gate, up)
    if f > MAX_WIDTH:
        raise ValueError(f"swiglu_rows_fp8: rows of at most {MAX_WIDTH} values, got {f}")
    q = torch.empty((b, f), dtype=torch.float8_e4m3fn, device=gate.device)
    scale = torch.empty((b, 1), dtype=torch.float32, device=gate.device)
    _swiglu_rows_fp8_kernel[(b,)](
        gate, up, q, scale, f, gate.stride(0), up.stride(0), q.stride(0),
        BLOCK=next_pow2(f), num_warps=16,
    )  # fmt: skip
    return q, scale
