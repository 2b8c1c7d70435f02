"""Weight-only INT8 GEMV for batch-1 decode (w8a16): `y = x @ (q * scale[:, None]).T`.

Contract
--------
- `quantize_int8(w[N, K]) -> (q int8 [N, K], scale [N])`: symmetric per-output-channel,
  `scale = absmax(row) / 127` (fp32 by default; a zero row gets scale 1), `q = round(w / scale)`
  clamped to [-127, 127].
- `int8_linear(x[..., K], q, scale) -> y[..., N]` in x's dtype (bf16/fp16/fp32), for 1..4 rows
  of x (decode). More rows raise ValueError: use a real GEMM there.
- `q` may also be float8_e4m3fn: the same kernels, each weight converted e4m3 -> fp32
  exactly (no magic: that trick is int8's); TMA configs refuse it. With `x_scale` (one row)
  x is itself e4m3 with that one float32 scale, and y = (x * x_scale) @ (q * scale).T in
  `out_dtype`: fp8_projections' products at one row, where cuBLASLt's FP8 GEMM reads the
  weights no faster than bf16 (benchmarks/h100/serving/fp8-gemm-kernel-quant.json: 1.01x).
- Accumulation is fp32; the scale is applied once per output, after the K loop.
- The launch only reads device memory and never synchronises with the host, so it can be
  captured in a CUDA graph. Split-K launches re-arm their semaphores themselves, so graph
  replays stay correct (the semaphore buffer is allocated on the first call: warm up before
  capture). Two split-K launches on *concurrent* streams would share that buffer: don't.

Why it is fast
--------------
Decode at M=1 is a pure weight stream: every weight byte is read once and used for one FMA.
INT8 halves the bytes of bf16, so at the same bandwidth the GEMV takes half the time.
- Each program owns BLOCK_N output rows and walks K in BLOCK_K chunks; a weight row chunk is
  contiguous, so each thread issues 16-byte loads (K % 16 == 0 keeps them aligned) and a warp
  reads whole 128-byte lines. Weights are loaded with evict_first (streamed once), x with
  evict_last (every program re-reads it from L2).
- The accumulator is a [BLOCK_N, BLOCK_K] fp32 tile: FMAs stay element-wise in registers and
  the cross-thread reduction happens once at the end, not once per chunk.
- int8 -> fp32 by float-bit arithmetic (magic=True: int add into the bits of 2**23, one FADD)
  instead of I2F, which runs at a quarter rate on sm_90 and alone caps the kernel near the
  HBM rate; optional register double-buffering (prefetch=True) keeps the next chunk's loads
  in flight during the FMAs.
- When N is small (the [2048 x 13056] o+down projection) there are too few programs to keep
  132 SMs' worth of loads in flight, so the K range is split across programs (split-K); the
  last program of each row block (counted with an atomic) sums the fp32 partials in a fixed
  order (deterministic) and writes the output: one launch, no second reduce kernel.
- For 2..4 rows the weights are still read once: a [16, BLOCK_K] x tile (rows beyond M are
  masked to zero) times the dequantised [BLOCK_K, BLOCK_N] weight tile on the tensor cores.
- `torch._weight_int8pack_mm` at M=1 is ~25x slower than cuBLAS bf16 on the H200, which is
  why this kernel exists.

Measured on the H200 (M=1, CUDA-graph replay, weights from HBM; copy ceiling 4.27 TB/s):
25088x2048 18.1 us = 2.85 TB/s (cuBLAS bf16 30.5 us); 2048x13056 11.7 us = 2.30 TB/s (bf16 17.3);
the 36-layer packed stack 1.01 ms = 2.79 TB/s, 65% of copy (bf16 1.66 ms), with PDL. The 80%
goal is not reached. M=2..4 (tensor-core path) is slower than bf16 for N=2048: M=1 only.

`GemvConfig(tma=True)` (M=1) runs int8_gemv_tma.py instead: weight tiles fetched by the
Hopper TMA into shared memory, `num_stages - 1` in flight ahead of the FMAs.

Tuning: `GEMV_CONFIGS` is the candidate list; `H200_CONFIGS` holds the winners measured on the
H200 keyed on (N, K); `tune_int8_linear` re-measures on the current GPU (do it before graph
capture: it launches many kernels and synchronises).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    graph_ms_per_call,
    interpreting,
    l2_copies,
    launch_options,
    patch_interpreter_scalars,
    pdl_enabled,
)
from .epilogue import split_k_buffers, split_k_plan, store_scaled
from .int8_fma import _fma

patch_interpreter_scalars()

MAX_ROWS = 4  # decode batch; beyond this a tensor-core GEMM is the right tool
WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
SMALL_M_BLOCK = 16  # tl.dot needs at least 16 rows: x rows M..15 are masked to zero


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the M=1 kernel (block_n/block_k/warps also used for M>1)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    prefetch: bool = False  # load chunk i+1 before the FMAs of chunk i
    magic: bool = False  # int8 -> fp32 by float-bit arithmetic instead of I2F
    # Two changes to the pointer kernel's schedule; with PDL at 25088 x 2048: 17.24 us plain,
    # 16.34 reduce_each, 16.13 both (benchmarks/h200/issue14-gemv-sweep-pdl.json). Inside a
    # decode step both together measured 1.02x [1.01, 1.04] (stack exp74-full-pdl-tuned:
    # benchmarks/h200/issue14-gemv-tables-ab.show.json), so neither is in H200_CONFIGS:
    preload: bool = False  # the first weight chunk in flight before the PDL wait
    reduce_each: bool = False  # a [BLOCK_N] accumulator: each chunk reduced at once, so the
    # registers of a [BLOCK_N, BLOCK_K] fp32 tile are free for wider chunks / more programs
    # weight tiles loaded by the TMA, num_stages - 1 in flight (int8_gemv_tma.py; M=1 only)
    tma: bool = False

    def __post_init__(self) -> None:
        if self.preload and self.prefetch:
            raise ValueError("GemvConfig: preload and prefetch both load the first chunk early")
        if self.tma and (self.prefetch or self.preload or self.reduce_each):
            raise ValueError("GemvConfig: tma pipelines its own loads (no prefetch, preload or "
                             "reduce_each)")  # fmt: skip


# Candidates swept by tune_int8_linear (and by benchmarks/kernels_bench.py --tune).
GEMV_CONFIGS: tuple[GemvConfig, ...] = (
    GemvConfig(8, 512, 4),
    GemvConfig(16, 256, 4),
    GemvConfig(4, 1024, 4),
    GemvConfig(8, 512, 4, num_stages=3),
    GemvConfig(16, 256, 4, prefetch=True),
    GemvConfig(8, 512, 4, prefetch=True),
    GemvConfig(4, 512, 4, prefetch=True),
    GemvConfig(8, 1024, 4, prefetch=True),
    GemvConfig(16, 256, 4, split_k=4, prefetch=True),
    GemvConfig(16, 256, 8, split_k=8, prefetch=True),
    GemvConfig(8, 512, 4, split_k=4),
    GemvConfig(8, 512, 4, magic=True),
    GemvConfig(16, 256, 4, magic=True),
    GemvConfig(4, 1024, 4, magic=True),
    GemvConfig(8, 512, 4, prefetch=True, magic=True),
    GemvConfig(16, 256, 4, prefetch=True, magic=True),
    GemvConfig(4, 512, 4, prefetch=True, magic=True),
    GemvConfig(8, 1024, 4, prefetch=True, magic=True),
    GemvConfig(16, 512, 8, prefetch=True, magic=True),
    GemvConfig(16, 256, 4, split_k=4, prefetch=True, magic=True),
    GemvConfig(16, 256, 8, split_k=8, prefetch=True, magic=True),
    GemvConfig(8, 512, 4, split_k=4, magic=True),
    GemvConfig(8, 256, 4, split_k=8, prefetch=True, magic=True),
)

# Winners measured on the H200 (M=1), keyed on (N, K). See benchmarks/kernels_bench.py --tune.
H200_CONFIGS: dict[tuple[int, int], GemvConfig] = {
    # (25088, 2048), (2048, 13056): benchmarks/h200/issue14-gemv-sweep.json and
    # issue14-gemv-sweep-refined.json (copy ceiling 4.23 TB/s). The first: 17.5 / 18.6 us in
    # the two sweeps, against 19.6 / 17.8 for (16, 256, 4), the winner measured 2026-11-29:
    # within run-to-run spread. The second: 10.8 / 10.9 us (58% of copy) against 11.5 / 11.6
    # for (8, 1024, 4, prefetch).
    (25088, 2048): GemvConfig(16, 512, 8, magic=True),
    (2048, 13056): GemvConfig(8, 2048, 8, magic=True),
    # measured 2026-11-29, M=1, graph replay over L2-busting copies; copy ceiling 4.27 TB/s
    (2048, 2048): GemvConfig(4, 1024, 4, magic=True),  # 3.6 us, launch-bound
    (11008, 2048): GemvConfig(16, 256, 4, magic=True),  # 9.4 us, 2.39 TB/s
    (2048, 11008): GemvConfig(8, 1024, 4, prefetch=True, magic=True),  # 10.2 us, 2.21 TB/s
}

# Tables a stack can choose (int8_projections' `gemv_configs`), each a set of measured winners
# that replace the shipped ones above for their shapes. A table ships as H200_CONFIGS only when
# an A/B inside a decode step says it pays.
GEMV_TABLES: dict[str, dict[tuple[int, int], GemvConfig]] = {
    "shipped": {},
    # The winners of the sweep with PDL, back-to-back launches overlapping as in a decode step
    # (benchmarks/h200/issue14-gemv-sweep-pdl.json, copy ceiling 4.17 TB/s): 16.34 us against
    # the shipped 17.24 at the input shape (reduce_each); the output shape's winner is the
    # shipped config (reduce_each costs it 10.50 -> 12.66 us). In a decode step, with preload:
    # 1.02x [1.01, 1.04] over shipped (benchmarks/h200/issue14-gemv-tables-ab.show.json).
    "pdl_tuned": {(25088, 2048): GemvConfig(16, 512, 8, magic=True, reduce_each=True)},
}

# Candidates for the TMA kernel at Rumik's two decode shapes, checked by the GPU and compile
# tests and timed by `benchmarks/gemv_sweep.py --tma`: every one slower than the pointer
# kernel (benchmarks/h200/issue14-gemv-sweep-tma.json), so none is in a table.
TMA_CONFIGS: dict[tuple[int, int], tuple[GemvConfig, ...]] = {
    (25088, 2048): tuple(
        GemvConfig(bn, bk, 8 if bn * bk >= 8192 else 4, num_stages=st, magic=True, tma=True)
        for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 6)
    ),
    (2048, 13056): (
        *(GemvConfig(bn, 256, 8 if bn >= 32 else 4, num_stages=st, split_k=sk, magic=True,
                     tma=True)
          for bn in (8, 16, 32) for st in (3, 4, 6) for sk in (1, 2, 4)),
        GemvConfig(16, 128, 4, num_stages=4, magic=True, tma=True),
        GemvConfig(16, 128, 4, num_stages=6, split_k=2, magic=True, tma=True),
    ),
}  # fmt: skip

_TUNED: dict[tuple[str, int, int, int], GemvConfig] = {}


# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_chunk(
    w_ptrs, x_ptr, offs_k, n_mask, k, k_hi,
    BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """Weights [BLOCK_N, BLOCK_K] (streamed: evict_first) and x [BLOCK_K] (reused: evict_last)."""
    if EVEN and not GUARD:  # in-range whole chunk: plain 16-byte vector loads
        w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + offs_k, eviction_policy="evict_last")
    elif EVEN:  # whole chunks, maybe past the end: one scalar predicate keeps vector loads
        ok = k < k_hi
        # other=0.0, a float: the interpreter cannot cast an integer 0 to FP8 (e4m3 weights)
        w = tl.load(w_ptrs + k, mask=ok, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + offs_k, mask=ok, other=0.0, eviction_policy="evict_last")
    else:
        k_mask = (k + offs_k) < k_hi
        w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0, eviction_policy="evict_last")
    return w, x


@triton.jit
def _int8_gemv_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    part_ptr,
    sem_ptr,
    N,
    K,
    K_PER_SPLIT,
    stride_qn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr,
    TAIL: tl.constexpr,
    PREFETCH: tl.constexpr,
    MAGIC: tl.constexpr,
    PRELOAD: tl.constexpr,
    REDUCE_EACH: tl.constexpr,
    USE_PDL: tl.constexpr,
    X_SCALED: tl.constexpr = False,
    xs_ptr=None,
    HAS_RES: tl.constexpr = False,
    res_ptr=None,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    # int64 row offsets: a packed weight can pass 2**31 bytes in other models
    w_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_k[None, :]
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if PRELOAD:  # weights never change: the first chunk may overlap the previous kernel
        if EVEN or TAIL:  # a whole first chunk (the launcher checks it for TAIL)
            w_first = tl.load(w_ptrs + k_lo, eviction_policy="evict_first")
        else:
            first_mask = n_mask[:, None] & ((k_lo + offs_k) < k_hi)[None, :]
            w_first = tl.load(w_ptrs + k_lo, mask=first_mask, other=0.0,
                              eviction_policy="evict_first")  # fmt: skip
    if USE_PDL:
        # x is written by the previous kernel; everything above overlapped with its tail
        tl.extra.cuda.gdc_wait()
    if REDUCE_EACH:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = k_lo
    if PRELOAD:
        x_first = tl.load(x_ptr + k_lo + offs_k, mask=(k_lo + offs_k) < k_hi, other=0.0,
                          eviction_policy="evict_last")  # fmt: skip
        acc = _fma(acc, w_first, x_first, MAGIC, REDUCE_EACH)
        k_start = k_lo + BLOCK_K
    if PREFETCH:
        # register double-buffering: the next chunk's loads are in flight during these FMAs
        w, x = _load_chunk(w_ptrs, x_ptr, offs_k, n_mask, k_lo, k_hi, BLOCK_K, EVEN, True)
        for k in range(k_lo, k_hi, BLOCK_K):
            w_next, x_next = _load_chunk(w_ptrs, x_ptr, offs_k, n_mask, k + BLOCK_K, k_hi,
                                         BLOCK_K, EVEN, True)  # fmt: skip
            acc = _fma(acc, w, x, MAGIC, REDUCE_EACH)
            w, x = w_next, x_next
    elif TAIL:
        # whole rows of blocks, K not a multiple of BLOCK_K: plain vector loads for the whole
        # chunks, per-element masks only on the last, partial one
        k_full = k_lo + ((k_hi - k_lo) // BLOCK_K) * BLOCK_K
        for k in range(k_start, k_full, BLOCK_K):
            w, x = _load_chunk(w_ptrs, x_ptr, offs_k, n_mask, k, k_hi, BLOCK_K, True, False)
            acc = _fma(acc, w, x, MAGIC, REDUCE_EACH)
        if k_full < k_hi:
            w, x = _load_chunk(w_ptrs, x_ptr, offs_k, n_mask, k_full, k_hi, BLOCK_K, False, False)
            acc = _fma(acc, w, x, MAGIC, REDUCE_EACH)
    else:
        for k in range(k_start, k_hi, BLOCK_K):
            w, x = _load_chunk(w_ptrs, x_ptr, offs_k, n_mask, k, k_hi, BLOCK_K, EVEN, False)
            acc = _fma(acc, w, x, MAGIC, REDUCE_EACH)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    part = acc if REDUCE_EACH else tl.sum(acc, axis=1)
    if X_SCALED:  # an e4m3 x row's own scale (fp8_projections), beside the weights'
        part = part * tl.load(xs_ptr)
    store_scaled(part, scale_ptr, out_ptr, part_ptr, sem_ptr, offs_n, n_mask,
                 pid_n, pid_k, N, BLOCK_N, SPLIT_K, res_ptr, HAS_RES)  # fmt: skip


@triton.jit
def _int8_gemm_small_m_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + offs_k[:, None]  # [BK, BN]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptrs + k, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_ptrs + k,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        # int8 or e4m3 -> fp32 -> x dtype: exact either way, and the interpreter mis-casts
        # int8 -> bf16
        w = w.to(tl.float32).to(x.dtype)
        if DOT_F32:  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y, mask=m_mask[:, None] & n_mask[None, :])


# --------------------------------------------------------------------------- torch side


def quantize_int8(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: returns (q int8 [N, K], scale [N])."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w32 / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(scale_dtype)


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: fp32 matmul against the dequantised weight, cast to x's dtype."""
    y = x.float() @ q.float().t()
    return (y * scale.float()).to(x.dtype)


def default_config(n: int, k: int) -> GemvConfig:
    """The measured H200 winner for (N, K), else a heuristic that keeps ~4 programs per SM."""
    if (n, k) in H200_CONFIGS:
        return H200_CONFIGS[(n, k)]
    if n >= 8192:  # plenty of row blocks: short rows, no split
        return GemvConfig(16, 256, 4, magic=True)
    if k >= 8192:  # few row blocks, long rows: keep the next chunk in flight
        return GemvConfig(8, 1024, 4, prefetch=True, magic=True)
    return GemvConfig(4, 1024, 4, magic=True)


def _check_inputs(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, x_scale: torch.Tensor | None = None
) -> tuple[int, int, int]:
    check_device("int8_linear", x, q, scale)
    if x_scale is None:
        check_dtype("int8_linear x", x, FLOAT_DTYPES)
    else:
        check_device("int8_linear", x, x_scale)
        check_dtype("int8_linear x (with x_scale)", x, (torch.float8_e4m3fn,))
        check_dtype("int8_linear x_scale", x_scale, (torch.float32,))
        if x_scale.numel() != 1 or x.numel() != x.shape[-1]:
            raise ValueError("int8_linear: x_scale goes with one row of x and is one value")
    check_dtype("int8_linear q", q, WEIGHT_DTYPES)
    check_dtype("int8_linear scale", scale, FLOAT_DTYPES)
    if q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"int8_linear: q must be [N, K] with contiguous rows, got {q.shape}")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"int8_linear: x has K={x.shape[-1]}, q has K={k}")
    if scale.numel() != n:
        raise ValueError(f"int8_linear: scale must have N={n} elements, got {scale.numel()}")
    m = x.numel() // k if k else 0
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"int8_linear: supports 1..{MAX_ROWS} rows of x (decode), got M={m}")
    return m, n, k


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    launch_pdl: bool = False,
    preload: bool = False,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ (q * scale[:, None]).T, for 1..4 rows of x. `preload` turns on
    the config's `preload` (one row only; a config with `prefetch` refuses it). With
    `x_scale`, x is one e4m3 row and y = (x * x_scale) @ ... in `out_dtype` (default bf16).
    With `residual` (one row, N values in the output's dtype; not the TMA kernel), y is
    residual + that product, summed in fp32 and rounded once."""
    m, n, k = _check_inputs(x, q, scale, x_scale)
    dtype = out_dtype or (torch.bfloat16 if x_scale is not None else x.dtype)
    if residual is not None:
        check_device("int8_linear", x, residual)
        check_dtype("int8_linear residual", residual, (dtype,))
        if m != 1 or residual.numel() != n or not residual.is_contiguous():
            raise ValueError(f"int8_linear: residual goes with one row: {n} contiguous values")
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"int8_linear: out must be contiguous {(m, n)} {dtype}")
    cfg = config or _TUNED.get((str(x.device), m == 1, n, k)) or default_config(n, k)
    # GemvConfig refuses preload with prefetch; a tma config's pipeline already loads ahead
    if preload and m == 1 and not cfg.preload and not cfg.tma:
        cfg = replace(cfg, preload=True)
    if cfg.tma and (q.dtype != torch.int8 or x_scale is not None or residual is not None):
        raise ValueError(
            "int8_linear: the TMA kernel reads int8 weights and an unscaled x, no residual"
        )
    if q.dtype == torch.float8_e4m3fn:  # e4m3 -> fp32 is a plain conversion
        cfg = replace(cfg, magic=False)
    use_pdl = pdl_enabled(launch_pdl, x.device)
    scale = scale.contiguous()
    if m == 1:
        _launch_gemv(x2, q, scale, out, cfg, use_pdl, x_scale, residual)
    else:
        _launch_small_m(x2, q, scale, out, cfg, use_pdl)
    return out.reshape(*x.shape[:-1], n)


def _launch_gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    cfg: GemvConfig,
    use_pdl: bool,
    x_scale: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    if cfg.tma:
        from .int8_gemv_tma import launch_gemv_tma

        return launch_gemv_tma(x, q, scale, out, cfg.block_n, cfg.block_k, cfg.split_k,
                               cfg.num_warps, cfg.num_stages, cfg.magic, use_pdl)  # fmt: skip
    n, k = q.shape
    split_k, k_per_split = split_k_plan(k, cfg.block_k, cfg.split_k)
    n_blocks = cdiv(n, cfg.block_n)
    even = k % cfg.block_k == 0 and n % cfg.block_n == 0
    tail = not even and n % cfg.block_n == 0 and not cfg.prefetch
    shortest = min(k_per_split, k - (split_k - 1) * k_per_split)  # the last split's length
    if cfg.preload and tail and shortest < cfg.block_k:
        raise ValueError(
            f"int8_linear: preload with K={k} needs whole first chunks of {cfg.block_k} per split"
        )
    part, sem = split_k_buffers(out, split_k, n, n_blocks)
    _int8_gemv_kernel[(n_blocks, split_k)](
        x,
        q,
        scale,
        out,
        part,
        sem,
        n,
        k,
        k_per_split,
        q.stride(0),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split_k,
        EVEN=even,
        TAIL=tail,
        PREFETCH=cfg.prefetch,
        MAGIC=cfg.magic,
        PRELOAD=cfg.preload,
        REDUCE_EACH=cfg.reduce_each,
        USE_PDL=use_pdl,
        X_SCALED=x_scale is not None,
        xs_ptr=x_scale,
        HAS_RES=residual is not None,
        res_ptr=residual,
        **launch_options(use_pdl, cfg.num_warps, cfg.num_stages),
    )


def _launch_small_m(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    cfg: GemvConfig,
    use_pdl: bool,
) -> None:
    m, k = x.shape
    n = q.shape[0]
    # [16, BK] x [BK, BN] tiles: keep the dequantised weight tile small enough for registers
    block_n = max(16, min(cfg.block_n * 2, 64))
    block_k = min(cfg.block_k, 256)
    _int8_gemm_small_m_kernel[(cdiv(n, block_n),)](
        x,
        q,
        scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        q.stride(0),
        out.stride(0),
        BLOCK_M=SMALL_M_BLOCK,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or interpreting() else "tf32",
        DOT_F32=interpreting() and x.dtype != torch.float32,
        USE_PDL=use_pdl,
        **launch_options(use_pdl, 4, 2),
    )


def tune_int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    configs: tuple[GemvConfig, ...] = GEMV_CONFIGS,
    *,
    launch_pdl: bool = False,
) -> tuple[GemvConfig, dict[GemvConfig, float]]:
    """Time every config (ms per call) and remember the fastest for this device/M/N/K.

    Timed as CUDA-graph replays over copies of q that together exceed the L2 four times, so
    neither host launch overhead nor L2 hits flatter small shapes; with `launch_pdl` each
    call overlaps the previous one's tail (where `preload` can pay). GPU only; synchronises, so
    call it before graph capture. Later int8_linear calls with the same device, M == 1 or not,
    N and K use the winner unless a config is passed explicitly.
    """
    m, n, k = _check_inputs(x, q, scale)
    if x.device.type != "cuda":
        raise ValueError("tune_int8_linear: needs a CUDA device")
    copies = [q] + [q.clone() for _ in range(l2_copies(x.device, q.numel()) - 1)]
    times: dict[GemvConfig, float] = {}
    for cfg in configs:
        calls = [
            lambda c=c, cfg=cfg: int8_linear(x, c, scale, config=cfg, launch_pdl=launch_pdl)
            for c in copies
        ]
        times[cfg] = graph_ms_per_call(calls)
    best = min(times, key=times.__getitem__)
    _TUNED[(str(x.device), m == 1, n, k)] = best
    return best, times
