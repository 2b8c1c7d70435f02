"""The parallel block's MLP activation and the packed output projection's input, in one launch.

Contract
--------
`swiglu_cat(attn[..., A], gate[..., F], up[..., F]) -> x[..., A + F]` with
x = cat([attn, silu(gate) * up]), rounded as the eager ops round it: silu in fp32 stored in the
input dtype (what `F.silu` stores), then the product of the two stored values in fp32, stored
in the input dtype (what `*` stores). One row (batch-1 decode); gate and up may be strided
views (column slices of the packed input projection's output): only the last dim must be
contiguous. No host synchronisation: CUDA-graph / device-loop safe.

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
    patch_interpreter_scalars,
    pdl_enabled,
)

patch_interpreter_scalars()

BLOCK = 1024


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
        g = tl.load(gate_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # F.silu stores this
        act = s.to(tl.float32) * u
        tl.store(out_ptr + A + offs, act.to(out_ptr.dtype.element_ty), mask=m)
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
