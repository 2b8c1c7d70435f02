"""Decode attention for many streams at once: one query token per row, each row over its own
cache length (issue 34's batched decode).

Contract
--------
`batched_decode_attention(q, k_cache, v_cache, lengths, window=0) -> out`
- q: [B, Hq, D]; k_cache, v_cache: [B, Hkv, S_max, D] (views of a larger static cache are
  fine: any strides but a contiguous last dim); D == 128; at most 16 query heads per KV head.
- lengths: [B] int32/int64 ON THE DEVICE, each row's valid positions (its current token
  included); `length_offset` is added on the device (a decoder passes its positions with 1).
  A row reads nothing at or beyond its length; a row of length 0 gives zeros. A length
  above S_max is not caught (checking it would sync with the device): the caller keeps
  its positions inside the cache (BatchedServer refuses a request that would not fit).
- window > 0: each row attends to its last `window` positions only (sliding layers).
- cache_rows: [B] int ON THE DEVICE, or None: query r reads cache row cache_rows[r] of
  caches with any number of rows (several queries may share one: a prompt's tokens
  written in one step, each at its own length; batched_decode's chunked prefill); None,
  query r reads cache row r.
- k_scale, v_scale: [B, Hkv, S_max] float32 (one stride layout for both, a contiguous last
  dim) with FP8 (e4m3) caches: position p's key is k_cache[..., p, :] * k_scale[..., p],
  its value likewise (APPROXIMATE: batched_decode's `kv: fp8`); None for a bf16/fp32
  cache, which must then share q's dtype. The same scales with uint8 caches [B, Hkv, S_max,
  D // 2]: packed INT4 (kernels/int4_cache.py's layout; APPROXIMATE), half the FP8 bytes.
- No host synchronisation, and a grid that depends only on the shapes (Hkv x splits x B), so
  a serving step captures it once per batch bucket and replays it for every mix of lengths.

Why: the plain batched step (SDPA with a per-row boolean mask) reads every row's cache up to
the bucket's context and runs SDPA's masked path. Here each row reads its own filled
positions once per KV head, G query heads together on the tensor cores (decode_attention's
inner loop, `attend_range`), and many rows fill the GPU without splitting a row's range
(`num_splits` 1, the default: one pass, no merge kernel).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import check_cache_rows, check_kv_scales, interpreting, next_pow2
from .decode_attention import (
    HEAD_DIM,
    LOG2E,
    MAX_GROUP,
    _check,
    _split_range,
    attend_range,
    merge_partials,
)


@triton.jit
def attend_range_int4(
    q_even, q_odd, k_base, v_base, start, end, qk_scale, stride_ks, stride_vs, ks_base,
    vs_base, G_PAD: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """attend_range over a packed INT4 cache (int4_cache.py): byte j of a position holds
    elements 2j and 2j + 1, so q and the output are taken as their even and odd halves and
    each dot runs twice over HALF columns, with no interleaving of the unpacked values.
    Returns (running max, running sum, even half of the output, odd half). The integers
    (|n| <= 8) are exact in fp16; the scales multiply as attend_range's do."""
    offs_h = tl.arange(0, HALF)
    offs_s = tl.arange(0, BLOCK_S)
    dot_dtype = tl.float32 if DOT_F32 or q_even.dtype == tl.float32 else tl.float16
    q_even = q_even.to(dot_dtype)
    q_odd = q_odd.to(dot_dtype)
    m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc_e = tl.zeros([G_PAD, HALF], dtype=tl.float32)
    acc_o = tl.zeros([G_PAD, HALF], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        pos = s0 + offs_s
        s_mask = pos < end
        kv_mask = s_mask[:, None]
        kb = tl.load(k_base + pos[:, None] * stride_ks + offs_h[None, :], mask=kv_mask, other=0)
        vb = tl.load(v_base + pos[:, None] * stride_vs + offs_h[None, :], mask=kv_mask, other=0)
        kb = kb.to(tl.int32)
        vb = vb.to(tl.int32)
        k_e = ((kb & 15) - 8).to(dot_dtype)
        k_o = ((kb >> 4) - 8).to(dot_dtype)
        qk = tl.dot(q_even, tl.trans(k_e), input_precision=PRECISION)
        qk = tl.dot(q_odd, tl.trans(k_o), qk, input_precision=PRECISION)
        qk = qk * tl.load(ks_base + pos, mask=s_mask, other=0.0)[None, :]
        qk = tl.where(s_mask[None, :], (qk * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: pos s0 is always valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = (p * tl.load(vs_base + pos, mask=s_mask, other=0.0)[None, :]).to(dot_dtype)
        v_e = ((vb & 15) - 8).to(dot_dtype)
        v_o = ((vb >> 4) - 8).to(dot_dtype)
        acc_e = acc_e * alpha[:, None] + tl.dot(p, v_e, input_precision=PRECISION)
        acc_o = acc_o * alpha[:, None] + tl.dot(p, v_o, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc_e, acc_o


@triton.jit
def _batched_split_kernel(
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
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    ks_ptr,
    vs_ptr,
    stride_sb,
    stride_sh,
    rows_ptr,
    HQ: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_SCALED: tl.constexpr,
    ROW_MAP: tl.constexpr,
    KV_INT4: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    cache_row = row  # ROW_MAP: the query's cache row, read from the map
    if ROW_MAP:
        cache_row = tl.load(rows_ptr + row).to(tl.int64)
    start, end, _ = _split_range(len_ptr + row, LEN_OFFSET, WINDOW, split, NUM_SPLITS, BLOCK_S)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    heads = kv_head * G + offs_g
    o_ptrs = out_ptr + row * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if start >= end:
        if NUM_SPLITS == 1:  # an empty row: zeros (the merge kernel writes them otherwise)
            zero = tl.zeros([G_PAD, D], dtype=tl.float32)
            tl.store(o_ptrs, zero.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        return
    k_base = k_ptr + cache_row * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + cache_row * stride_vb + kv_head.to(tl.int64) * stride_vh
    scales = cache_row * stride_sb + kv_head.to(tl.int64) * stride_sh  # FP8/INT4: [B, Hkv, S]
    if KV_INT4:  # the even and odd halves of q and of the output (int4_cache.py's pairs)
        offs_h = tl.arange(0, D // 2)
        q_half = q_ptr + row * stride_qb + heads[:, None] * stride_qh + 2 * offs_h[None, :]
        q_even = tl.load(q_half, mask=g_mask[:, None], other=0)
        q_odd = tl.load(q_half + 1, mask=g_mask[:, None], other=0)
        m_i, l_i, acc_e, acc_o = attend_range_int4(
            q_even, q_odd, k_base, v_base, start, end, qk_scale, stride_ks, stride_vs,
            ks_ptr + scales, vs_ptr + scales, G_PAD, D // 2, BLOCK_S, PRECISION, DOT_F32,
        )  # fmt: skip
        o_half = out_ptr + row * stride_ob + heads[:, None] * stride_oh + 2 * offs_h[None, :]
        if NUM_SPLITS == 1:
            dt = out_ptr.dtype.element_ty
            tl.store(o_half, (acc_e / l_i[:, None]).to(dt), mask=g_mask[:, None])
            tl.store(o_half + 1, (acc_o / l_i[:, None]).to(dt), mask=g_mask[:, None])
        else:
            part = (row * HQ + heads) * NUM_SPLITS + split
            p_half = acc_ptr + part[:, None] * D + 2 * offs_h[None, :]
            tl.store(p_half, acc_e, mask=g_mask[:, None])
            tl.store(p_half + 1, acc_o, mask=g_mask[:, None])
            tl.store(ml_ptr + part * 2, m_i, mask=g_mask)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_mask)
        return
    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=g_mask[:, None], other=0)
    m_i, l_i, acc = attend_range(
        q, k_base, v_base, start, end, qk_scale, stride_ks, stride_vs,
        ks_ptr + scales, vs_ptr + scales,
        G_PAD, D, BLOCK_S, PRECISION, DOT_F32, KV_SCALED,
    )  # fmt: skip
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        part = (row * HQ + heads) * NUM_SPLITS + split
        tl.store(acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _batched_reduce_kernel(
    len_ptr,
    acc_ptr,
    ml_ptr,
    out_ptr,
    LEN_OFFSET,
    WINDOW,
    stride_ob,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    _, _, n_active = _split_range(len_ptr + row, LEN_OFFSET, WINDOW, 0, NUM_SPLITS, BLOCK_S)
    offs_p = tl.arange(0, SPLITS_PAD)
    p_mask = offs_p < n_active  # partials of empty splits were never written
    o = merge_partials(acc_ptr, ml_ptr, (row * HQ + head) * NUM_SPLITS + offs_p, p_mask, D)
    o_ptrs = out_ptr + row * stride_ob + head * stride_oh + tl.arange(0, D)
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty))


def batched_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    window: int = 0,
    length_offset: int = 0,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int = 1,
    block_s: int = 64,
    num_stages: int = 3,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query r against the first `lengths[r] + length_offset` positions of its cache row
    (`cache_rows[r]`, else row r)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            "batched_decode_attention: q must be [B, Hq, D] and the caches [B, Hkv, S_max, D], "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    b = q.shape[0]
    if cache_rows is not None:
        check_cache_rows("batched_decode_attention", cache_rows, b, q.device)
        if v_cache.shape[0] != k_cache.shape[0]:
            raise ValueError("batched_decode_attention: k_cache and v_cache differ in rows")
    elif k_cache.shape[0] != b or v_cache.shape[0] != b:
        rows = k_cache.shape[0]
        raise ValueError(f"batched_decode_attention: {b} query rows but caches of {rows}")
    if lengths.shape != (b,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"batched_decode_attention: lengths must be [{b}] int32 or int64")
    if lengths.device != q.device or not lengths.is_contiguous():
        raise ValueError("batched_decode_attention: lengths must be contiguous, on q's device")
    if window < 0:
        raise ValueError(f"batched_decode_attention: window must be >= 0, got {window}")
    scaled = check_kv_scales("batched_decode_attention", k_cache, k_scale, v_scale)
    int4 = k_cache.dtype == torch.uint8
    if int4:
        hq, hkv = _check_int4(q, k_cache, v_cache, scaled, num_splits, block_s)
    else:
        hq, hkv, _ = _check(q[0], k_cache[0], v_cache[0], num_splits, block_s, kv_fp8=scaled)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"batched_decode_attention: out must be {tuple(q.shape)} {q.dtype}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(HEAD_DIM)
    fp32 = q.dtype == torch.float32
    if num_splits > 1:
        parts = b * hq * num_splits
        part_acc = torch.empty((parts, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((parts, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused in the single pass
    _batched_split_kernel[(hkv, num_splits, b)](
        q, k_cache, v_cache, lengths, out, part_acc, part_ml,
        int(length_offset), int(window), scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        k_scale if scaled else k_cache, v_scale if scaled else v_cache,  # unread unless scaled
        k_scale.stride(0) if scaled else 0, k_scale.stride(1) if scaled else 0,
        cache_rows if cache_rows is not None else lengths,  # unread without a map
        HQ=hq, G=hq // hkv, G_PAD=MAX_GROUP, D=HEAD_DIM, BLOCK_S=block_s,
        NUM_SPLITS=num_splits,
        PRECISION="ieee" if fp32 or interpreting() else "tf32",
        DOT_F32=interpreting() and not fp32,
        KV_SCALED=scaled, ROW_MAP=cache_rows is not None, KV_INT4=int4,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _batched_reduce_kernel[(hq, b)](
            lengths, part_acc, part_ml, out, int(length_offset), int(window),
            out.stride(0), out.stride(1),
            HQ=hq, D=HEAD_DIM, BLOCK_S=block_s, NUM_SPLITS=num_splits,
            SPLITS_PAD=next_pow2(num_splits), num_warps=4, num_stages=1,
        )  # fmt: skip
    return out


def _check_int4(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scaled: bool,
    num_splits: int,
    block_s: int,
) -> tuple[int, int]:
    """A packed INT4 cache's shapes and limits (decode_attention's `_check` for the rest);
    (Hq, Hkv)."""
    name = "batched_decode_attention"
    if not scaled:
        raise ValueError(f"{name}: a uint8 (packed INT4) cache needs k_scale and v_scale")
    if v_cache.dtype != torch.uint8 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: k_cache and v_cache must both be uint8 of one shape")
    if k_cache.shape[-1] * 2 != HEAD_DIM or q.shape[-1] != HEAD_DIM:
        raise ValueError(
            f"{name}: packed INT4 caches hold {HEAD_DIM // 2} bytes a position for head_dim "
            f"{HEAD_DIM}, got q {q.shape[-1]} and cache {k_cache.shape[-1]}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: caches must have a contiguous last dim")
    # the rest as decode_attention checks it, on a float view of one row's shapes
    like = torch.empty((*k_cache.shape[1:3], HEAD_DIM), dtype=q.dtype, device="meta")
    hq, hkv, _ = _check(q[0], like, like, num_splits, block_s)
    return hq, hkv


def batched_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: list[int],
    *,
    window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    cache_rows: list[int] | None = None,
) -> torch.Tensor:
    """Torch reference, row by row (fp32 softmax over each row's valid, windowed slice); an
    FP8 or packed INT4 cache is dequantized with its scales first; `cache_rows` maps queries
    to rows."""
    from .decode_attention import decode_attention_ref

    if cache_rows is not None:
        index = torch.tensor(cache_rows, device=k_cache.device)
        k_cache, v_cache = k_cache[index], v_cache[index]
        if k_scale is not None and v_scale is not None:
            k_scale, v_scale = k_scale[index], v_scale[index]

    if k_cache.dtype == torch.uint8 and k_scale is not None and v_scale is not None:
        from .int4_cache import dequantize_int4

        k_cache = dequantize_int4(k_cache, k_scale).to(q.dtype)
        v_cache = dequantize_int4(v_cache, v_scale).to(q.dtype)
    elif k_scale is not None and v_scale is not None:
        k_cache = (k_cache.float() * k_scale[..., None]).to(q.dtype)
        v_cache = (v_cache.float() * v_scale[..., None]).to(q.dtype)
    rows = [
        decode_attention_ref(q[r], k_cache[r], v_cache[r], n, window=window)
        for r, n in enumerate(lengths)
    ]
    return torch.stack(rows)
