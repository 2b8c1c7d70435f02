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
  cache, which must then share q's dtype.
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
    q_rows = q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_rows, mask=g_mask[:, None], other=0)
    k_base = k_ptr + cache_row * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + cache_row * stride_vb + kv_head.to(tl.int64) * stride_vh
    scales = cache_row * stride_sb + kv_head.to(tl.int64) * stride_sh  # FP8: [B, Hkv, S]
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
        KV_SCALED=scaled, ROW_MAP=cache_rows is not None,
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
    FP8 cache is dequantized with its scales first; `cache_rows` maps queries to rows."""
    from .decode_attention import decode_attention_ref

    if cache_rows is not None:
        index = torch.tensor(cache_rows, device=k_cache.device)
        k_cache, v_cache = k_cache[index], v_cache[index]
        if k_scale is not None and v_scale is not None:
            k_scale, v_scale = k_scale[index], v_scale[index]

    if k_scale is not None and v_scale is not None:
        k_cache = (k_cache.float() * k_scale[..., None]).to(q.dtype)
        v_cache = (v_cache.float() * v_scale[..., None]).to(q.dtype)
    rows = [
        decode_attention_ref(q[r], k_cache[r], v_cache[r], n, window=window)
        for r, n in enumerate(lengths)
    ]
    return torch.stack(rows)
