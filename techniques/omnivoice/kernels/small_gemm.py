"""y = x @ w.T for OmniVoice's few-row GEMMs, split over K so that more programs stream w.

Contract
--------
`small_gemm(x[M, K], w[N, K], config) -> y[M, N]` in x's dtype (bf16 or fp16; fp32 under the
interpreter too), accumulated in fp32. x's and w's last dims contiguous. With
`config.split_k` = S > 1, program (m, n, s) multiplies the s-th of S equal K ranges into an
fp32 workspace [S, M, N], then torch sums the S partials and rounds once: deterministic (no
atomics), the same result for the same config on every run, equal to the unsplit product up
to fp32 summation order. K must divide into S ranges of whole
BLOCK_K chunks (the launcher refuses anything else, naming the config).

Why
---
Each unmasking forward of the packed backbone multiplies 156 rows (the CFG pair of 78
positions for ov-tput) by four weights a layer: q|k|v [4096, 1024], o_proj [1024, 2048],
gate|up [6144, 1024], down [1024, 3072]. cuBLAS picks 64-row tiles for them and takes 5.6-7.4
us each (benchmarks/h200/issue14-ov-qkv-v5-profile.json): o_proj reads its 4.2 MB at about
0.6 TB/s, because 156 x 1024 outputs in 64 x 128 tiles are only 24 programs for 132 SMs.
Splitting K multiplies the programs that stream w.

benchmarks/ov_gemm_sweep.py times its configs against cuBLAS at those four shapes on the H200
(CUDA-graph replay over weight copies larger than the L2); ov_packed_projections takes a
config per shape (its `small_gemm` param, through `small_gemm_op`, a torch.library
triton_op that torch.compile keeps in its graph) only where that sweep says it wins.
"""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from orchestrate.api.device import interpreting

# The packed backbone's weights a layer, (N, K), at OmniVoice's real size (Qwen3-0.6B)
OV_SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
             "down": (1024, 3072)}  # fmt: skip


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (m, n, s): out[s, m-block, n-block] = x[m-block, s-th K range] @ w[...].T."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_s * K_PER_SPLIT
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, K_PER_SPLIT, BLOCK_K):
        k = k0 + i
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask, other=0.0)
        b = tl.load(w_cols + (k + offs_k)[:, None], mask=n_mask, other=0.0)
        # Under Triton's CPU interpreter (triton 3.x) tl.dot of bf16 tiles returns garbage
        # (~1e10 for unit inputs): there the operands go to fp32 first, so the interpreter
        # checks the indexing, masks and K split; the bf16 product is checked on the GPU.
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    out = out_ptr + pid_s.to(tl.int64) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask & n_mask)


def _check(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"small_gemm: x [M, K] and w [N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("small_gemm: x's and w's last dims must be contiguous")
    if x.dtype != w.dtype:
        raise ValueError(f"small_gemm: x is {x.dtype}, w is {w.dtype}")
    if x.device != w.device or (x.device.type != "cuda" and not interpreting()):
        raise ValueError(f"small_gemm: needs both on one CUDA device, got {x.device}, {w.device}")
    if why := split_problem(x.shape[1], config):
        raise ValueError(f"small_gemm: {why} ({config})")


def split_problem(k: int, config: GemmConfig) -> str | None:
    """Why `config` cannot run a K of `k` (its split leaves a partial chunk), or None."""
    s, bk = config.split_k, config.block_k
    if s < 1 or k % (s * bk):
        return f"K={k} does not split into {s} ranges of whole {bk}-wide chunks"
    return None


def small_gemm(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """The contract above: one launch, plus the partials' sum when split_k > 1."""
    return _launch(_gemm_kernel, x, w, config)


def _launch(kernel: Any, x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """small_gemm with `kernel` the plain jit function or the triton_op's wrapped one."""
    _check(x, w, config)
    (m, k), n, s = x.shape, w.shape[0], config.split_k
    # Never a view returned: under compile a triton_op's view outputs are cloned around it
    if s == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:  # fp32 partials, summed below in split order
        out = torch.empty((s, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), s)
    kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(-2), m * n,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        K_PER_SPLIT=k // s, UPCAST=interpreting() and x.dtype != torch.float32,
        # float32 operands get an fp32 product: tl.dot's default rounds them to TF32 on
        # the GPU (relative error ~8e-4 against the fp32 product on an H100:
        # benchmarks/h100/kernel-tests-gpu-9-failed.log); bf16 operands are exact in either.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out if s == 1 else out.sum(0, dtype=torch.float32).to(x.dtype)


@functools.cache
def _op() -> Any:
    from torch.library import triton_op, wrap_triton

    def launch(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int,
               split_k: int, num_warps: int, num_stages: int) -> torch.Tensor:  # fmt: skip
        cfg = GemmConfig(block_m, block_n, block_k, split_k, num_warps, num_stages)
        return _launch(wrap_triton(_gemm_kernel), x, w, cfg)

    return triton_op("orchestrate::ov_small_gemm", mutates_args=())(launch)


def small_gemm_op(x: torch.Tensor, w: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """small_gemm as `torch.ops.orchestrate.ov_small_gemm` (registered on first use): the
    config goes in as ints, so each config compiles to its own specialised launch."""
    return _op()(x, w, *astuple(config))


def small_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 product rounded once to x's dtype."""
    return (x.float() @ w.float().T).to(x.dtype)
