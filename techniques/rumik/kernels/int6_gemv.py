"""Weight-only INT6 GEMV for batch-1 decode: 4 weights in 3 bytes, unpacked in registers.

Contract
--------
- `quantize_int6(w[N, K]) -> (packed uint8 [N, 3K/4], scale [N])`: symmetric per-output-
  channel, `scale = absmax(row) / 31` (fp32; a zero row gets scale 1), `q = round(w / scale)`
  clamped to [-31, 31] and stored biased as u = q + 32 (6 bits, 1..63). K % 4 == 0.
- Layout ("quarter planes"): with Q = K/4, the weights of column j of the four quarters,
  u_t = u[:, t*Q + j] for t = 0..3, form one 24-bit word u_0 | u_1 << 6 | u_2 << 12 | u_3 << 18
  whose three bytes go to three planes: packed[:, j], packed[:, Q + j], packed[:, 2Q + j].
  A chunk of the GEMV therefore reads three contiguous byte runs of the weight row and four
  contiguous runs of x (one per quarter): every load is a plain vector load, and no byte is
  shared between chunks, whatever the block size.
- `int6_linear(x[..., K], packed, scale) -> y[..., N]` in x's dtype for ONE row of x (decode);
  more rows raise ValueError (multiply by `dequantize_int6` there). fp32 accumulation, the
  scale applied once per output after the K loop.
- No host synchronisation, CUDA-graph safe. Split-K launches share the epilogue's semaphores
  and re-arm them, so graph replays stay correct (allocated on first call: warm up first).

Cost model (why it may lose to INT8 although it moves 25% fewer bytes)
----------------------------------------------------------------------
Per weight INT8 (magic path) needs one integer add + FADD + FMA; INT6 needs the byte
assembly (two shifts/ORs per 4 weights), a shift, an AND, an OR and an FADD per weight before
the FMA, so it needs about twice INT8's ALU work per byte while the bytes fall by a quarter.
On an H200 (4.3 TB/s, ~67 TFLOP/s fp32 FMA) both are nominally bandwidth-bound, but at
M=1 the per-SM issue rate and the load latency hidden per warp decide: the seed measured
INT6 34.56% slower per audio second than its INT8 parent. The benchmark
(benchmarks/kernels_bench.py, section `int6`) measures it here rather than assuming either.

Dequantisation uses the same float-bit trick as INT8: u (0..63) OR'ed into the mantissa of
2**23 gives 2**23 + u exactly, minus (2**23 + 32) = q; no I2F (quarter rate on sm_90).
With PDL the first weight chunk is loaded before gdc_wait(): weights are immutable, so that
load may overlap the previous kernel's tail; x is only read after the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    cdiv,
    check_device,
    check_dtype,
    graph_ms_per_call,
    l2_copies,
    launch_options,
    patch_interpreter_scalars,
    pdl_enabled,
)
from .epilogue import split_k_buffers, split_k_plan, store_scaled

patch_interpreter_scalars()

QMAX = 31
BIAS = 32


@dataclass(frozen=True)
class Int6Config:
    """One launch configuration: BLOCK_N rows x BLOCK_J packed columns (4 x BLOCK_J weights)."""

    block_n: int
    block_j: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1


INT6_CONFIGS: tuple[Int6Config, ...] = (
    Int6Config(16, 64, 4),
    Int6Config(16, 128, 4),
    Int6Config(8, 128, 4),
    Int6Config(8, 256, 4),
    Int6Config(4, 256, 4),
    Int6Config(4, 512, 4),
    Int6Config(32, 64, 4),
    Int6Config(16, 128, 8),
    Int6Config(8, 256, 8),
    Int6Config(16, 64, 4, split_k=4),
    Int6Config(8, 128, 4, split_k=4),
    Int6Config(8, 256, 4, split_k=2),
    Int6Config(16, 128, 4, split_k=4),
    Int6Config(8, 128, 4, split_k=8),
)

_TUNED: dict[tuple[str, int, int], Int6Config] = {}


@triton.jit
def _load_planes(row_ptrs, Q, j, offs_j, n_mask, j_hi, EVEN: tl.constexpr):
    """The three byte planes of packed columns [j, j + BLOCK_J) (zeros past j_hi)."""
    if EVEN:  # whole chunks; one scalar predicate guards the prefetch past the end
        ok = j < j_hi
        b0 = tl.load(row_ptrs + j, mask=ok, other=0, eviction_policy="evict_first")
        b1 = tl.load(row_ptrs + Q + j, mask=ok, other=0, eviction_policy="evict_first")
        b2 = tl.load(row_ptrs + 2 * Q + j, mask=ok, other=0, eviction_policy="evict_first")
    else:
        m = n_mask[:, None] & ((j + offs_j) < j_hi)[None, :]
        b0 = tl.load(row_ptrs + j, mask=m, other=0, eviction_policy="evict_first")
        b1 = tl.load(row_ptrs + Q + j, mask=m, other=0, eviction_policy="evict_first")
        b2 = tl.load(row_ptrs + 2 * Q + j, mask=m, other=0, eviction_policy="evict_first")
    return b0, b1, b2


@triton.jit
def _unpack(word, SHIFT: tl.constexpr):
    """6-bit field at SHIFT -> exact fp32 q in [-32, 31] via the 2**23 mantissa trick."""
    bits = ((word >> SHIFT) & 63) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388640.0  # 2**23 + 32


@triton.jit
def _int6_gemv_kernel(
    x_ptr, p_ptr, scale_ptr, out_ptr, part_ptr, sem_ptr,
    N, Q, J_PER_SPLIT, stride_pn,
    BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_J)
    n_mask = offs_n < N
    row_ptrs = p_ptr + offs_n.to(tl.int64)[:, None] * stride_pn + offs_j[None, :]
    j_lo = pid_k * J_PER_SPLIT
    j_hi = tl.minimum(j_lo + J_PER_SPLIT, Q)
    # weights never change: the first chunk is in flight before waiting on the previous kernel
    b0, b1, b2 = _load_planes(row_ptrs, Q, j_lo, offs_j, n_mask, j_hi, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x is written by the previous kernel
    acc = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    for j in range(j_lo, j_hi, BLOCK_J):
        xm = (j + offs_j) < j_hi
        x0 = tl.load(x_ptr + j + offs_j, mask=xm, other=0.0, eviction_policy="evict_last")
        x1 = tl.load(x_ptr + Q + j + offs_j, mask=xm, other=0.0, eviction_policy="evict_last")
        x2 = tl.load(x_ptr + 2 * Q + j + offs_j, mask=xm, other=0.0, eviction_policy="evict_last")
        x3 = tl.load(x_ptr + 3 * Q + j + offs_j, mask=xm, other=0.0, eviction_policy="evict_last")
        # next chunk's bytes in flight during this chunk's unpack + FMAs
        n0, n1, n2 = _load_planes(row_ptrs, Q, j + BLOCK_J, offs_j, n_mask, j_hi, EVEN)
        word = b0.to(tl.int32) | (b1.to(tl.int32) << 8) | (b2.to(tl.int32) << 16)
        acc += _unpack(word, 0) * x0.to(tl.float32)[None, :]
        acc += _unpack(word, 6) * x1.to(tl.float32)[None, :]
        acc += _unpack(word, 12) * x2.to(tl.float32)[None, :]
        acc += _unpack(word, 18) * x3.to(tl.float32)[None, :]
        b0, b1, b2 = n0, n1, n2
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_scaled(tl.sum(acc, axis=1), scale_ptr, out_ptr, part_ptr, sem_ptr, offs_n, n_mask,
                 pid_n, pid_k, N, BLOCK_N, SPLIT_K)  # fmt: skip


# --------------------------------------------------------------------------- torch side


def quantize_int6(
    w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT6 packed 4-in-3: (packed uint8 [N, 3K/4], scale [N])."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int6: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % 4:
        raise ValueError(f"quantize_int6: K must be a multiple of 4 (4 in 3 bytes), got {k}")
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    u = (torch.round(w32 / scale[:, None]).clamp_(-QMAX, QMAX) + BIAS).to(torch.int32)
    q4 = k // 4
    quarters = u.view(n, 4, q4)
    word = quarters[:, 0] | (quarters[:, 1] << 6) | (quarters[:, 2] << 12) | (quarters[:, 3] << 18)
    planes = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], dim=1)
    return planes.to(torch.uint8).reshape(n, 3 * q4).contiguous(), scale.to(scale_dtype)


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, 3K/4] -> q int8 [N, K] in [-31, 31]."""
    n, b = packed.shape
    if b % 3:
        raise ValueError(f"unpack_int6: packed width must be a multiple of 3, got {b}")
    q4 = b // 3
    p = packed.to(torch.int32).view(n, 3, q4)
    word = p[:, 0] | (p[:, 1] << 8) | (p[:, 2] << 16)
    u = torch.cat([(word >> s) & 63 for s in (0, 6, 12, 18)], dim=1)
    return (u - BIAS).to(torch.int8)


def dequantize_int6(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (unpack_int6(packed).float() * scale.float()[:, None]).to(dtype)


def int6_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch reference: fp32 matmul against the unpacked weight, scaled, cast to x's dtype."""
    y = x.float() @ unpack_int6(packed).float().t()
    return (y * scale.float()).to(x.dtype)


def default_config(n: int, k: int) -> Int6Config:
    """Heuristic (untuned): short rows with many row blocks; long rows with few, split-K."""
    if n >= 8192:
        return Int6Config(16, 128, 4)
    if k >= 8192:
        return Int6Config(8, 256, 4, split_k=2)
    return Int6Config(4, 256, 4)


def _check_inputs(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    check_device("int6_linear", x, packed, scale)
    check_dtype("int6_linear x", x, FLOAT_DTYPES)
    check_dtype("int6_linear packed", packed, (torch.uint8,))
    check_dtype("int6_linear scale", scale, FLOAT_DTYPES)
    if packed.dim() != 2 or packed.stride(1) != 1 or packed.shape[1] % 3:
        raise ValueError(
            f"int6_linear: packed must be [N, 3K/4] uint8 with contiguous rows, got {packed.shape}"
        )
    n, k = packed.shape[0], packed.shape[1] // 3 * 4
    if x.shape[-1] != k:
        raise ValueError(f"int6_linear: x has K={x.shape[-1]}, packed holds K={k}")
    if scale.numel() != n:
        raise ValueError(f"int6_linear: scale must have N={n} elements, got {scale.numel()}")
    m = x.numel() // k if k else 0
    if m != 1:
        raise ValueError(f"int6_linear: supports one row of x (batch-1 decode), got M={m}")
    return n, k


def int6_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: Int6Config | None = None,
    out: torch.Tensor | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """y[..., N] = x[..., K] @ (unpack(packed) * scale[:, None]).T for one row of x."""
    n, k = _check_inputs(x, packed, scale)
    x1 = x.reshape(k)
    if x1.stride(0) != 1:
        x1 = x1.contiguous()
    if out is None:
        out = torch.empty(n, dtype=x.dtype, device=x.device)
    elif out.numel() != n or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"int6_linear: out must be contiguous with {n} elements of {x.dtype}")
    cfg = config or _TUNED.get((str(x.device), n, k)) or default_config(n, k)
    use_pdl = pdl_enabled(launch_pdl, x.device)
    q4 = k // 4
    split_k, j_per_split = split_k_plan(q4, cfg.block_j, cfg.split_k)
    n_blocks = cdiv(n, cfg.block_n)
    even = q4 % j_per_split == 0 and j_per_split % cfg.block_j == 0 and n % cfg.block_n == 0
    part, sem = split_k_buffers(out, split_k, n, n_blocks)
    _int6_gemv_kernel[(n_blocks, split_k)](
        x1, packed, scale.contiguous(), out, part, sem,
        n, q4, j_per_split, packed.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_J=cfg.block_j, SPLIT_K=split_k, EVEN=even,
        USE_PDL=use_pdl, **launch_options(use_pdl, cfg.num_warps, cfg.num_stages),
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)


def tune_int6_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    configs: tuple[Int6Config, ...] = INT6_CONFIGS,
) -> tuple[Int6Config, dict[Int6Config, float]]:
    """Time every config (ms per call, CUDA-graph replays over L2-busting copies of the
    weights) and remember the fastest for this device/N/K. GPU only; call before capture."""
    n, k = _check_inputs(x, packed, scale)
    if x.device.type != "cuda":
        raise ValueError("tune_int6_linear: needs a CUDA device")
    copies = [packed] + [packed.clone() for _ in range(l2_copies(x.device, packed.numel()) - 1)]
    times: dict[Int6Config, float] = {}
    for cfg in configs:
        calls = [lambda c=c, cfg=cfg: int6_linear(x, c, scale, config=cfg) for c in copies]
        times[cfg] = graph_ms_per_call(calls)
    best = min(times, key=times.__getitem__)
    _TUNED[(str(x.device), n, k)] = best
    return best, times
