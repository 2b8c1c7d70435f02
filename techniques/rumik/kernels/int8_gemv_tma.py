"""The M=1 INT8 GEMV with its weight tiles fetched by the Hopper TMA, software-pipelined.

Same contract and result as int8_gemv's M=1 kernel (`GemvConfig(tma=True)` selects this one;
int8_linear dispatches). Why a second kernel: the pointer kernel keeps a weight chunk in
flight per program in registers (one, or two with `prefetch`), and the best configs of its
sweeps reach 58-72% of the H200's copy bandwidth (benchmarks/h200/kernels.json,
issue14-gemv-sweep.json, issue14-gemv-sweep-refined.json, issue14-gemv-sweep-pdl.json).
Here each [BLOCK_N, BLOCK_K] tile is one bulk copy into shared memory issued by the TMA, and
Triton's pipeliner keeps `num_stages - 1` tiles in flight ahead of the FMAs, so the bytes in
flight per program grow with the stages instead of the registers.

- The descriptor zero-fills tiles past N and K, so no masks on the weights: a partial last
  chunk (13056 = 51 x 256) reads zeros, and x is masked to zero past the split's end, so a
  tile reaching into the next split adds nothing.
- TMA boxes are at most 256 elements a side: BLOCK_N, BLOCK_K <= 256 (the launcher checks).
- The dequantisation, FMAs and epilogue are int8_gemv's (`_fma`, `store_scaled`): the same
  fp32 products accumulated per lane in the same order. Under the interpreter the output is
  the pointer kernel's bit for bit (the CPU test); compiled, the last row reduction follows
  the register layout the compiler picks, so the GPU test bounds the difference instead.
- Exactness class: that of int8_projections (APPROXIMATE: int8 weights); against the pointer
  kernel only the summation order can differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import cdiv, launch_options
from .epilogue import split_k_buffers, split_k_plan, store_scaled
from .int8_fma import _fma

TMA_BOX_MAX = 256  # elements per side of one TMA box


@triton.jit
def _int8_gemv_tma_kernel(
    x_ptr,
    q_desc,
    scale_ptr,
    out_ptr,
    part_ptr,
    sem_ptr,
    N,
    K,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    MAGIC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w = q_desc.load([n0, k])  # zeros past N and K
        x = tl.load(x_ptr + k + offs_k, mask=(k + offs_k) < k_hi, other=0.0,
                    eviction_policy="evict_last")  # fmt: skip
        acc = _fma(acc, w, x, MAGIC, False)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_scaled(tl.sum(acc, axis=1), scale_ptr, out_ptr, part_ptr, sem_ptr, offs_n, n_mask,
                 pid_n, pid_k, N, BLOCK_N, SPLIT_K)  # fmt: skip


def launch_gemv_tma(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    bn: int,
    bk: int,
    split_k: int,
    num_warps: int,
    num_stages: int,
    magic: bool,
    use_pdl: bool,
) -> None:
    """One M=1 launch of a GemvConfig with tma=True (int8_linear checked the operands)."""
    n, k = q.shape
    if bn > TMA_BOX_MAX or bk > TMA_BOX_MAX:
        raise ValueError(f"int8_linear: a TMA tile is at most {TMA_BOX_MAX} a side, got {bn}x{bk}")
    if q.data_ptr() % 16 or k % 16:
        raise ValueError("int8_linear: the TMA needs 16-byte aligned weight rows (K % 16 == 0)")
    split_k, k_per_split = split_k_plan(k, bk, split_k)
    n_blocks = cdiv(n, bn)
    part, sem = split_k_buffers(out, split_k, n, n_blocks)
    desc = TensorDescriptor.from_tensor(q, [bn, bk])
    _int8_gemv_tma_kernel[(n_blocks, split_k)](
        x, desc, scale, out, part, sem, n, k, k_per_split,
        BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, STAGES=num_stages,
        MAGIC=magic, USE_PDL=use_pdl,
        **launch_options(use_pdl, num_warps, num_stages),
    )  # fmt: skip
