"""GQA decode attention for one query token, with the sequence length read from the device.

Contract
--------
`decode_attention(q, k_cache, v_cache, length, window=0) -> out`
- q: [1, Hq, D] or [Hq, D]; k_cache, v_cache: [1, Hkv, S_max, D] or [Hkv, S_max, D]; D == 128,
  Hq a multiple of Hkv with at most 16 query heads per KV head; bf16, fp16 or fp32; the last
  dim contiguous (other strides free, so views of a larger static cache work).
- length: a one-element int32/int64 tensor ON THE DEVICE = number of valid cache positions,
  the current token's own key/value included (it was written at length - 1). Positions
  >= length are never read, so they may hold anything (NaN, the previous utterance).
  `length_offset` (a Python int) is added on the device: a decoder passes its position
  tensor with length_offset=1 instead of launching `position + 1` for every layer.
- window > 0 (a Python int, fixed per layer): attend only to the last `window` positions,
  [max(0, length - window), length), as transformers' sliding-window mask does
  (kv_idx > q_idx - window). window == 0: all positions [0, length).
- Scale 1/sqrt(D) unless sm_scale is given. Output [.., Hq, D] shaped like q, q's dtype.
  length == 0 gives zeros.
- No host synchronisation and a grid that depends only on the shapes (Hkv x num_splits), so
  it can be captured once in a CUDA graph (or run inside a device-side while loop) and
  replayed for every length: the length is only ever read inside the kernels.

Why it is fast
--------------
At batch 1 the cost is the K/V bytes read, so the kernels read every valid K/V row exactly
once and nothing beyond the length:
- One program per (KV head, split): the G = Hq/Hkv query heads that share a KV head are
  processed together ([16, D] x [D, BLOCK_S] on the tensor cores, rows >= G masked), so GQA
  costs no extra K/V traffic.
- Flash-decoding split-K: the valid range is cut into num_splits equal slices computed on the
  device from the length, so the work is spread over all Hkv * num_splits programs whether
  the length is 100 or 8192; programs whose slice is empty exit at once. Each program keeps
  an online softmax (running max, running sum, exp2 with log2(e) folded into the scale) and
  writes unnormalised partials; a second small kernel merges them (log-sum-exp weights).
  Merging inside the split launch instead (the last program of each KV head, counted with an
  atomic, merges its G heads) was measured slower on the H200: 1.908 against 1.699 ms per
  token for exp74-full (benchmarks/h200/issue14-merge-variants-profile.json); the merge runs
  serially in 4 programs at the tail, where the second kernel spreads it over 16.
- num_splits=1 is the single-pass variant: one program per KV head normalises and writes the
  output directly (no second kernel; only for very short caches: 4 programs cannot stream).

Measured on the H200 (bf16, 16/4 heads, per layer, CUDA-graph replay over 48 caches, PDL on):
length 1124: 4.9 us (SDPA on the sliced cache 8.5 us); 4096: 6.8 us (9.2); 8192: 9.3 us (12.4),
with the defaults num_splits=64, block_s=64, num_stages=3. At these sizes the two launches,
not the bytes, dominate (8192: 16.8 MB in 9.3 us = 1.8 TB/s).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_scalar_tensor,
    interpreting,
    launch_options,
    next_pow2,
    patch_interpreter_scalars,
    pdl_enabled,
)

patch_interpreter_scalars()

HEAD_DIM = 128
MAX_GROUP = 16  # query heads per KV head: the q tile is padded to 16 rows for tl.dot
MAX_SEQ = 131072
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


@triton.jit
def _split_range(
    len_ptr, LEN_OFFSET, WINDOW, split, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr
):
    """[start, end) of this split, and the number of non-empty splits, from the device length."""
    length = tl.load(len_ptr).to(tl.int32) + LEN_OFFSET
    lo = tl.where(WINDOW > 0, tl.maximum(length - WINDOW, 0), 0)
    n_blocks = tl.cdiv(length - lo, BLOCK_S)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS) * BLOCK_S
    n_active = tl.cdiv(length - lo, tl.maximum(per_split, 1))
    start = lo + split * per_split
    end = tl.minimum(start + per_split, length)
    return start, end, n_active


@triton.jit
def attend_range(
    q,
    k_base,
    v_base,
    start,
    end,
    qk_scale,
    stride_ks,
    stride_vs,
    ks_base,
    vs_base,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """The G_PAD query rows `q` of one KV head against its cache positions [start, end), an
    online softmax: (running max, running sum, unnormalised output), as exp2 with log2(e) in
    `qk_scale`. Shared by the one-stream and the batched kernels.

    KV_SCALED: the cache holds FP8 keys and values, each position's vector with its own
    float32 scale (`ks_base[pos]`, `vs_base[pos]`; contiguous per head). A key's scale
    multiplies its scores, a value's scale its softmax weights in the value sum (not in the
    normaliser): the same sums as over the dequantized cache, without writing it. The dots
    then run in fp16 (fp32 for an fp32 q): e4m3 -> fp16 is one instruction per pair on
    sm_90, where e4m3 -> bf16 takes several (measured: the bf16 dots left the FP8 cache's
    attention at 1.8 TB/s); q (bf16, |q| < 65504) and the softmax weights (<= 1) keep at
    least bf16's precision."""
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, BLOCK_S)
    if KV_SCALED and q.dtype != tl.float32:
        q = q.to(tl.float16)
    if DOT_F32:  # interpreter only: its tl.dot cannot multiply bf16/fp16
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        pos = s0 + offs_s
        s_mask = pos < end
        kv_mask = s_mask[:, None]
        # other=0.0, a float: the interpreter cannot cast an integer 0 to FP8
        k = tl.load(k_base + pos[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_SCALED:  # e4m3 -> fp16 (or fp32) is exact
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if KV_SCALED:
            qk = qk * tl.load(ks_base + pos, mask=s_mask, other=0.0)[None, :]
        # fp32 scale: under inductor a Python float argument arrives as fp64, which would
        # promote the running max to fp64 (a loop-carried type change Triton rejects)
        qk = tl.where(s_mask[None, :], (qk * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: pos s0 is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_SCALED:
            p = p * tl.load(vs_base + pos, mask=s_mask, other=0.0)[None, :]
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attn_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    len_ptr,
    out_ptr,
    acc_ptr,
    ml_ptr,
    LEN_OFFSET,
    WINDOW,
    qk_scale,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q, the cache write and the length come from earlier kernels
    start, end, _ = _split_range(len_ptr, LEN_OFFSET, WINDOW, split, NUM_SPLITS, BLOCK_S)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    heads = kv_head * G + offs_g
    if start >= end:
        # Beyond the length: nothing to read. Split runs leave the output to the reduce,
        # which writes zeros at length 0; the single pass writes the contract's zeros itself.
        if NUM_SPLITS == 1:
            zeros = tl.zeros((G_PAD, D), dtype=out_ptr.dtype.element_ty)
            o_ptrs = out_ptr + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, zeros, mask=g_mask[:, None])
        return
    q = tl.load(q_ptr + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    m_i, l_i, acc = attend_range(
        q, k_base, v_base, start, end, qk_scale, stride_ks, stride_vs, k_base, v_base,
        G_PAD, D, BLOCK_S, PRECISION, DOT_F32, False,
    )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if NUM_SPLITS == 1:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = heads * NUM_SPLITS + split
        tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def merge_partials(acc_ptr, ml_ptr, part, p_mask, D: tl.constexpr):
    """One head's output row from its splits' unnormalised partials (rows `part` where
    `p_mask`), merged with log-sum-exp weights. Shared by the one-stream and batched kernels."""
    offs_d = tl.arange(0, D)
    m = tl.load(ml_ptr + part * 2, mask=p_mask, other=float("-inf"))
    l_part = tl.load(ml_ptr + part * 2 + 1, mask=p_mask, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * D + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # length 0: every weight is 0
    w = tl.where(p_mask, tl.exp2(m - m_max), 0.0)
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l_part * w, axis=0)
    return num / tl.where(den > 0, den, 1.0)


@triton.jit
def _attn_reduce_kernel(
    len_ptr,
    acc_ptr,
    ml_ptr,
    out_ptr,
    LEN_OFFSET,
    WINDOW,
    stride_oh,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    head = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    _, _, n_active = _split_range(len_ptr, LEN_OFFSET, WINDOW, 0, NUM_SPLITS, BLOCK_S)
    offs_p = tl.arange(0, SPLITS_PAD)
    p_mask = offs_p < n_active  # partials of empty splits were never written
    o = merge_partials(acc_ptr, ml_ptr, head * NUM_SPLITS + offs_p, p_mask, D)
    tl.store(out_ptr + head * stride_oh + tl.arange(0, D), o.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- torch side


def _as_3d_cache(name: str, cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() == 4:
        if cache.shape[0] != 1:
            raise ValueError(f"{name}: batch must be 1, got {cache.shape[0]}")
        cache = cache[0]
    if cache.dim() != 3:
        raise ValueError(f"{name}: expected [1, Hkv, S_max, D] or [Hkv, S_max, D]")
    return cache


def _as_2d_q(q: torch.Tensor) -> torch.Tensor:
    if q.dim() == 3:
        if q.shape[0] != 1:
            raise ValueError(f"decode_attention: q batch must be 1, got {q.shape[0]}")
        q = q[0]
    if q.dim() != 2:
        raise ValueError(f"decode_attention: q must be [1, Hq, D] or [Hq, D], got {q.shape}")
    return q


def _window_range(length: int, window: int) -> tuple[int, int]:
    lo = max(0, length - window) if window > 0 else 0
    return lo, length


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: int | torch.Tensor,
    *,
    window: int = 0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Torch reference (fp32 softmax over the valid, windowed slice); syncs on a tensor length."""
    q2 = _as_2d_q(q).float()
    k = _as_3d_cache("k_cache", k_cache).float()
    v = _as_3d_cache("v_cache", v_cache).float()
    n_len = int(length.item()) if isinstance(length, torch.Tensor) else int(length)
    lo, hi = _window_range(n_len, window)
    group = q2.shape[0] // k.shape[0]
    if hi <= lo:
        return torch.zeros_like(q)
    k = k[:, lo:hi].repeat_interleave(group, dim=0)  # [Hq, L, D]
    v = v[:, lo:hi].repeat_interleave(group, dim=0)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q2.shape[-1])
    scores = torch.einsum("hd,hld->hl", q2, k) * scale
    out = torch.einsum("hl,hld->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype).reshape(q.shape)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_splits: int,
    block_s: int,
    kv_fp8: bool = False,
) -> tuple[int, int, int]:
    """Shapes, dtypes and limits; (Hq, Hkv, S_max). `kv_fp8`: e4m3 caches beside q's dtype
    (their scales are the batched kernel's to check)."""
    cache_dtypes = (torch.float8_e4m3fn,) if kv_fp8 else FLOAT_DTYPES
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        check_dtype(f"decode_attention {name}", t, FLOAT_DTYPES if name == "q" else cache_dtypes)
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must have a contiguous last dim")
    hq, d = q.shape
    hkv, s_max, dk = k.shape
    if d != HEAD_DIM or dk != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        raise ValueError(f"decode_attention: head_dim must be {HEAD_DIM}, got q {d}, k {dk}")
    if v.shape != k.shape or k.dtype != v.dtype or (q.dtype != k.dtype and not kv_fp8):
        raise ValueError("decode_attention: q, k_cache, v_cache must share a dtype; k, v a shape")
    if hq % hkv or hq // hkv > MAX_GROUP:
        raise ValueError(
            f"decode_attention: Hq={hq} must be a multiple of Hkv={hkv} with at most "
            f"{MAX_GROUP} query heads per KV head"
        )
    if s_max > MAX_SEQ:
        raise ValueError(f"decode_attention: S_max={s_max} exceeds the limit {MAX_SEQ}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: num_splits must be 1..{MAX_SPLITS}, got {num_splits}")
    if block_s not in (16, 32, 64, 128):
        raise ValueError(f"decode_attention: block_s must be 16, 32, 64 or 128, got {block_s}")
    return hq, hkv, s_max


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    *,
    window: int = 0,
    length_offset: int = 0,
    sm_scale: float | None = None,
    num_splits: int = 64,
    block_s: int = 64,
    num_stages: int = 3,
    out: torch.Tensor | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query token over the first `length + length_offset` (device) cache
    positions.

    num_splits / block_s / num_stages are launch shape only (the grid is Hkv x num_splits);
    the defaults were the fastest measured on the H200 for lengths 1k-8k.
    """
    q2 = _as_2d_q(q)
    k = _as_3d_cache("k_cache", k_cache)
    v = _as_3d_cache("v_cache", v_cache)
    device = check_device("decode_attention", q2, k, v)
    check_scalar_tensor("decode_attention length", length, device)
    hq, hkv, _ = _check(q2, k, v, num_splits, block_s)
    if window < 0:
        raise ValueError(f"decode_attention: window must be >= 0, got {window}")
    if out is None:
        out = torch.empty_like(q2)
    elif out.numel() != q2.numel() or out.dtype != q2.dtype or not out.is_contiguous():
        raise ValueError(f"decode_attention: out must be contiguous {tuple(q2.shape)} {q2.dtype}")
    out2 = out.view(hq, HEAD_DIM)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(HEAD_DIM)
    use_pdl = pdl_enabled(launch_pdl, device)
    if num_splits > 1:
        part_acc = torch.empty((hq * num_splits, HEAD_DIM), dtype=torch.float32, device=device)
        part_ml = torch.empty((hq * num_splits, 2), dtype=torch.float32, device=device)
    else:
        part_acc = part_ml = out2  # unused in the single-pass variant
    fp32 = q2.dtype == torch.float32
    precision = "ieee" if fp32 or interpreting() else "tf32"  # tf32: the default, a no-op on bf16
    _attn_split_kernel[(hkv, num_splits)](
        q2,
        k,
        v,
        length,
        out2,
        part_acc,
        part_ml,
        int(length_offset),
        int(window),
        scale * LOG2E,
        q2.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out2.stride(0),
        G=hq // hkv,
        G_PAD=MAX_GROUP,
        D=HEAD_DIM,
        BLOCK_S=block_s,
        NUM_SPLITS=num_splits,
        PRECISION=precision,
        DOT_F32=interpreting() and not fp32,
        USE_PDL=use_pdl,
        **launch_options(use_pdl, 4, num_stages),
    )
    if num_splits > 1:
        _attn_reduce_kernel[(hq,)](
            length,
            part_acc,
            part_ml,
            out2,
            int(length_offset),
            int(window),
            out2.stride(0),
            D=HEAD_DIM,
            BLOCK_S=block_s,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits),
            USE_PDL=use_pdl,
            **launch_options(use_pdl, 4, 1),
        )
    return out.view(q.shape)
