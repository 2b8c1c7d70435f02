"""The INT8 decode GEMVs with the glue around them folded in: two launches fewer per layer.

Contract
--------
- `int8_linear_rope_act(x[K], q[N, K], scale[N], pos, cos, sin, k_cache, v_cache, *, q_size,
  kv_size, rotary)` -> (q_rot[Q], act[F]): the packed input projection of one decode row,
  whose rows are [q | k | v | (gate_j, up_j) pairs] (`interleave_gate_up` builds that order),
  then what `rope_norm.rope_and_cache_write` and `swiglu.swiglu_cat` do with it: q rotated
  (interleaved pairs 2i, 2i+1 of each head, at the position read from device memory), k rotated
  and written into the cache row `pos`, v written into its cache row, act = silu(gate) * up.
  The projection's own output row is never stored.
- `int8_linear_cat(attn[A], act[F], q[N, A + F], scale[N])` -> y[N]: the packed output
  projection of cat([attn, act]), read from the two rows (the concatenation is never stored).
- The same roundings as the unfused launches: the GEMV's fp32 sum times the scale, stored in
  x's dtype, is what the rotary and the activation read; silu(gate) is stored in that dtype
  before the product, the product before the output GEMV reads it. Under the interpreter the
  fused and unfused paths give the same bits (tests/test_kernels.py); compiled, a row's fp32
  sum may be reduced in another order (another tile shape), so they agree up to that order
  (tests/test_gpu.py). M = 1 only, no split-K or register prefetch (a config's block sizes,
  warps and `magic` are used): the decode shapes have enough row blocks. No host
  synchronisation: CUDA-graph and device-loop safe.

Why
---
exp74-full launched, per layer, a rotary + cache-write kernel after the input GEMV and a
SwiGLU + pack kernel before the output GEMV: two of its seven launches a layer (3.5 and 1.2 us
a call, benchmarks/h200/issue14-exp74-fused-profile-v1.json). A program here owns pairs of
rows (an even and an odd accumulator), so a rotary pair, or a (gate_j, up_j) pair, is finished
where it is summed: the epilogue costs one table load or one exp per pair.

The activation is computed in the input GEMV's epilogue, not in the output GEMV's x load:
there every one of that GEMV's 256 programs would recompute all 11,008 activations (about
20 MB of L2 reads a call), which took it from 10.5 to 13.2 us a call, more than the launch it
saves (benchmarks/h200/issue14-exp74-fused-profile-v1.json). The epilogue's position, table
and scale loads stay after the K loop: read before it, GPU-busy was 1.456 ms a token against
1.398 (benchmarks/h200/issue14-exp74-fused-v3.result.json against
issue14-exp74-fused-v2.result.json).

Measured on the H200 (exp74-fused against exp74-full in one worker): no gain. 72 launches a
token fewer, and the two fused GEMVs took about as much longer as the two launches took
(GPU-busy 1.398 against 1.386 ms a token): the step's time is the GEMVs' own.

With PDL (`preload`), each program loads its first weight chunk before gdc_wait(): weights
never change, so that load overlaps the previous kernel's tail; x is read only after the wait
(int6_gemv does the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import int8_gemv
from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_row,
    check_scalar_tensor,
    launch_options,
    patch_interpreter_scalars,
    pdl_enabled,
)
from .int8_fma import _dequant
from .int8_gemv import GemvConfig

patch_interpreter_scalars()


@triton.jit
def _w_chunk(ptrs, k, K, offs_k, EVEN: tl.constexpr):
    """A [rows, BLOCK_K] int8 weight tile at column k (streamed once: evict_first)."""
    if EVEN:
        return tl.load(ptrs + k, eviction_policy="evict_first")
    return tl.load(ptrs + k, mask=((k + offs_k) < K)[None, :], other=0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _x_chunk(x_ptr, k, K, offs_k, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + k + offs_k, eviction_policy="evict_last").to(tl.float32)
    return tl.load(x_ptr + k + offs_k, mask=(k + offs_k) < K, other=0.0,
                   eviction_policy="evict_last").to(tl.float32)  # fmt: skip


@triton.jit
def _gemv_rope_act_kernel(
    x_ptr, q_ptr, scale_ptr, q_out_ptr, act_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    K, Q, KV, S_MAX, TABLE_LEN, stride_qn, stride_kch, stride_kcs, stride_vch, stride_vcs,
    HEAD_DIM: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    MAGIC: tl.constexpr, ROTARY: tl.constexpr, PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * (2 * PAIRS) + 2 * tl.arange(0, PAIRS)  # the even row of each pair
    offs_k = tl.arange(0, BLOCK_K)
    even_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qn + offs_k[None, :]
    odd_ptrs = even_ptrs + stride_qn
    acc_e = tl.zeros([PAIRS, BLOCK_K], dtype=tl.float32)
    acc_o = tl.zeros([PAIRS, BLOCK_K], dtype=tl.float32)
    if PRELOAD:  # weights never change: in flight before waiting on the previous kernel
        we = _w_chunk(even_ptrs, 0, K, offs_k, EVEN)
        wo = _w_chunk(odd_ptrs, 0, K, offs_k, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x and the position come from earlier kernels
    if PRELOAD:
        x = _x_chunk(x_ptr, 0, K, offs_k, EVEN)
        acc_e += _dequant(we, MAGIC) * x[None, :]
        acc_o += _dequant(wo, MAGIC) * x[None, :]
    for k in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
        x = _x_chunk(x_ptr, k, K, offs_k, EVEN)
        acc_e += _dequant(_w_chunk(even_ptrs, k, K, offs_k, EVEN), MAGIC) * x[None, :]
        acc_o += _dequant(_w_chunk(odd_ptrs, k, K, offs_k, EVEN), MAGIC) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dt = q_out_ptr.dtype.element_ty
    # the plain GEMV's output, rounded as it stores it: what the rotary and SwiGLU kernels read
    ye = (tl.sum(acc_e, axis=1) * tl.load(scale_ptr + rows).to(tl.float32)).to(dt)
    yo = (tl.sum(acc_o, axis=1) * tl.load(scale_ptr + rows + 1).to(tl.float32)).to(dt)
    ye = ye.to(tl.float32)
    yo = yo.to(tl.float32)
    pos = tl.load(pos_ptr).to(tl.int64)
    is_q = rows < Q
    is_k = (rows >= Q) & (rows < Q + KV)
    is_v = (rows >= Q + KV) & (rows < Q + 2 * KV)
    is_act = rows >= Q + 2 * KV  # (gate_j, up_j) pairs
    re, ro = ye, yo
    if ROTARY:
        turn = (is_q | is_k) & (pos >= 0) & (pos < TABLE_LEN)
        j = (rows % HEAD_DIM) // 2  # the pair's index in its head: Q and KV are whole heads
        c = tl.load(cos_ptr + pos * (HEAD_DIM // 2) + j, mask=turn, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * (HEAD_DIM // 2) + j, mask=turn, other=0.0).to(tl.float32)
        re = tl.where(turn, ye * c - yo * s, ye)  # rope_norm._rotate_heads' arithmetic
        ro = tl.where(turn, yo * c + ye * s, yo)
    tl.store(q_out_ptr + rows, re.to(dt), mask=is_q)
    tl.store(q_out_ptr + rows + 1, ro.to(dt), mask=is_q)
    in_cache = (pos >= 0) & (pos < S_MAX)  # never write outside the cache
    kr = rows - Q
    k_dst = kc_ptr + (kr // HEAD_DIM) * stride_kch + pos * stride_kcs + kr % HEAD_DIM
    tl.store(k_dst, re.to(kc_ptr.dtype.element_ty), mask=is_k & in_cache)
    tl.store(k_dst + 1, ro.to(kc_ptr.dtype.element_ty), mask=is_k & in_cache)
    vr = rows - Q - KV
    v_dst = vc_ptr + (vr // HEAD_DIM) * stride_vch + pos * stride_vcs + vr % HEAD_DIM
    tl.store(v_dst, ye.to(vc_ptr.dtype.element_ty), mask=is_v & in_cache)
    tl.store(v_dst + 1, yo.to(vc_ptr.dtype.element_ty), mask=is_v & in_cache)
    silu = (ye / (1.0 + tl.exp(-ye))).to(dt)  # F.silu stores this
    act = (silu.to(tl.float32) * yo).to(dt)  # and `*` stores this
    tl.store(act_ptr + (rows - Q - 2 * KV) // 2, act, mask=is_act)


@triton.jit
def _cat_x_chunk(attn_ptr, act_ptr, k, A, K, offs_k):
    """x[k : k + BLOCK_K] of cat([attn, act]), read from the two rows."""
    idx = k + offs_k
    in_attn = idx < A
    a = tl.load(attn_ptr + idx, mask=in_attn, other=0.0, eviction_policy="evict_last")
    b = tl.load(act_ptr + idx - A, mask=(idx >= A) & (idx < K), other=0.0,
                eviction_policy="evict_last")  # fmt: skip
    return tl.where(in_attn, a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _gemv_cat_kernel(
    attn_ptr, act_ptr, q_ptr, scale_ptr, out_ptr, K, A, stride_qn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, MAGIC: tl.constexpr,
    PRELOAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PRELOAD:
        w = _w_chunk(w_ptrs, 0, K, offs_k, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # attn and act come from earlier kernels
    if PRELOAD:
        acc += _dequant(w, MAGIC) * _cat_x_chunk(attn_ptr, act_ptr, 0, A, K, offs_k)[None, :]
    for k in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
        x = _cat_x_chunk(attn_ptr, act_ptr, k, A, K, offs_k)
        acc += _dequant(_w_chunk(w_ptrs, k, K, offs_k, EVEN), MAGIC) * x[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = tl.load(scale_ptr + offs_n).to(tl.float32)
    tl.store(out_ptr + offs_n, (tl.sum(acc, axis=1) * scale).to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- torch side


def _weights(name: str, q: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[int, int]:
    check_dtype(f"{name} q", q, (torch.int8,))
    check_dtype(f"{name} scale", scale, FLOAT_DTYPES)
    if q.dim() != 2 or q.stride(1) != 1 or q.shape[1] != k:
        raise ValueError(f"{name}: q must be [N, {k}] with contiguous rows, got {tuple(q.shape)}")
    if scale.numel() != q.shape[0] or not scale.is_contiguous():
        raise ValueError(f"{name}: scale must be {q.shape[0]} contiguous elements")
    return q.shape[0], k


def _block(cfg: GemvConfig, n: int, name: str) -> GemvConfig:
    if n % cfg.block_n:
        raise ValueError(f"{name}: N={n} must be a multiple of the config's block_n {cfg.block_n}")
    return cfg


def interleave_gate_up(t: torch.Tensor, start: int) -> torch.Tensor:
    """Rows [start:] of t, [gate (F); up (F)], reordered as pairs (gate_j, up_j): the order
    `int8_linear_rope_act` reads. Rows before `start` (q, k, v) are kept."""
    gu = t[start:]
    if gu.shape[0] % 2:
        raise ValueError(f"interleave_gate_up: {gu.shape[0]} rows after {start} are not gate + up")
    pairs = gu.reshape(2, gu.shape[0] // 2, *gu.shape[1:]).transpose(0, 1)
    return torch.cat([t[:start], pairs.reshape(gu.shape)]).contiguous()


def int8_linear_rope_act(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_size: int,
    kv_size: int,
    rotary: bool = True,
    config: GemvConfig | None = None,
    preload: bool = True,
    launch_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, silu(gate) * up) of x @ (q * scale).T, whose rows are [q | k | v | (gate_j,
    up_j) pairs] (interleave_gate_up); k rotated and v are written into the caches at `pos`."""
    from .rope_norm import _as_3d

    name = "int8_linear_rope_act"
    kc, vc = _as_3d(k_cache), _as_3d(v_cache)
    d = kc.shape[-1]
    x = check_row(f"{name} x", x)
    device = check_device(name, x, q, scale, cos, sin, kc, vc)
    check_scalar_tensor(f"{name} pos", pos, device)
    for t in (x, cos, sin, kc, vc):
        check_dtype(name, t, FLOAT_DTYPES)
    n, k = _weights(name, q, scale, x.shape[-1])
    if d % 2 or d & (d - 1) or q_size % d or kv_size % d or kv_size != kc.shape[0] * d:
        raise ValueError(f"{name}: q_size, kv_size must be whole heads of the caches' {d}")
    rest = n - q_size - 2 * kv_size
    if rest <= 0 or rest % 2 or kc.shape != vc.shape or kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError(f"{name}: N={n} must hold q, k, v and gate/up pairs; caches dense")
    table_ok = cos.dim() == 2 and cos.shape[1] == d // 2 and cos.is_contiguous()
    if cos.shape != sin.shape or not table_ok:
        raise ValueError(f"{name}: cos/sin must be contiguous [P, {d // 2}]")
    cfg = _block(config or int8_gemv.default_config(n, k), n, name)
    if cfg.block_n % 2:
        raise ValueError(f"{name}: block_n must be even (a program owns pairs of rows)")
    q_out = torch.empty(q_size, dtype=x.dtype, device=device)
    act = torch.empty(rest // 2, dtype=x.dtype, device=device)
    use_pdl = pdl_enabled(launch_pdl, device)
    _gemv_rope_act_kernel[(n // cfg.block_n,)](
        x, q, scale, q_out, act, pos, cos, sin, kc, vc,
        k, q_size, kv_size, kc.shape[1], cos.shape[0], q.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        HEAD_DIM=d, PAIRS=cfg.block_n // 2, BLOCK_K=cfg.block_k, EVEN=k % cfg.block_k == 0,
        MAGIC=cfg.magic, ROTARY=bool(rotary), PRELOAD=preload, USE_PDL=use_pdl,
        **launch_options(use_pdl, cfg.num_warps),
    )  # fmt: skip
    return q_out, act


def int8_linear_cat(
    attn: torch.Tensor,
    act: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    config: GemvConfig | None = None,
    preload: bool = True,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """y = cat([attn, act]) @ (q * scale).T, the concatenated row never stored."""
    name = "int8_linear_cat"
    for label, t in (("attn", attn), ("act", act)):
        check_row(f"{name} {label}", t)
        check_dtype(f"{name} {label}", t, FLOAT_DTYPES)
    device = check_device(name, attn, act, q, scale)
    if attn.dtype != act.dtype:
        raise ValueError(f"{name}: attn and act must share a dtype")
    a = attn.shape[-1]
    n, k = _weights(name, q, scale, a + act.shape[-1])
    cfg = _block(config or int8_gemv.default_config(n, k), n, name)
    out = torch.empty(n, dtype=attn.dtype, device=device)
    use_pdl = pdl_enabled(launch_pdl, device)
    _gemv_cat_kernel[(n // cfg.block_n,)](
        attn, act, q, scale, out, k, a, q.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN=k % cfg.block_k == 0, MAGIC=cfg.magic,
        PRELOAD=preload, USE_PDL=use_pdl, **launch_options(use_pdl, cfg.num_warps),
    )  # fmt: skip
    return out
