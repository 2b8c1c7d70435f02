"""A streaming codec's attention over each row's ring of keys, read in place by row index
(MimiStream kv="ring", the serving codec's transformer).

Contract
--------
`ring_attention(q, keys, values, rows, slot_position, q_position, window, scale)`:
- q [b, H, t, D]: the chunk's queries, t positions each (any strides but a contiguous D);
- keys, values [R, Hkv, S, D]: every state row's ring of S slots (H a multiple of Hkv);
- rows [b]: the state row each query row reads; slot_position [R, S]: the position each
  slot's key is of (-1: none yet); q_position [b, t]: each query's position.
out [b, H, t, D] in q's dtype: per query, softmax(q . k * scale) @ v over the slots of its
row whose position p has p >= 0 and 0 <= q_pos - p < window. A query that sees no slot
gets zeros (MimiStream's queries always see their own key). Accumulation in fp32; with fp32
inputs the dots are IEEE fp32 (no TF32). No host synchronisation: CUDA-graph safe.

Why it exists
-------------
The torch form gathers each decoded row's whole ring (`keys[rows]`: a copy of every key and
value the attention then reads again) and runs a masked SDPA over it. At 512 rows of the
real Mimi (8 layers, 8 heads, 252 slots of 64) that gather and attention took 7.6 of a
17.3 ms decode on an H100 (benchmarks/h100/serving/codec-ring-profile.json). Here one
program per (row, head) streams its ring once, slot blocks with an online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check_device, check_dtype, interpreting, next_pow2

BLOCK_S = 64  # slots per step of the online softmax
MIN_BLOCK_T = 16  # tl.dot needs 16 rows: query rows t..15 are masked


@triton.jit
def _ring_attention_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, slot_ptr, qpos_ptr, out_ptr,
    T, S, window, scale,
    sq_b, sq_h, sq_t, sk_r, sk_h, sk_s, sv_r, sv_h, sv_s, ss_r, sp_b, so_b, so_h, so_t,
    GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    t_mask = offs_t < T
    q = tl.load(q_ptr + i * sq_b + h * sq_h + offs_t[:, None] * sq_t + offs_d[None, :],
                mask=t_mask[:, None], other=0.0)  # fmt: skip
    q_pos = tl.load(qpos_ptr + i * sp_b + offs_t, mask=t_mask, other=0)
    k_base = k_ptr + row * sk_r + (h // GROUPS) * sk_h
    v_base = v_ptr + row * sv_r + (h // GROUPS) * sv_h
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_mask = offs_s < S
        k_pos = tl.load(slot_ptr + row * ss_r + offs_s, mask=s_mask, other=-1)
        k = tl.load(k_base + offs_s[:, None] * sk_s + offs_d[None, :], mask=s_mask[:, None],
                    other=0.0)  # fmt: skip
        v = tl.load(v_base + offs_s[:, None] * sv_s + offs_d[None, :], mask=s_mask[:, None],
                    other=0.0)  # fmt: skip
        gap = q_pos[:, None] - k_pos[None, :]
        seen = (k_pos[None, :] >= 0) & (gap >= 0) & (gap < window) & t_mask[:, None]
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        # a query that has seen nothing yet: keep its sums at zero, not exp(-inf + inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - m_ref[:, None])
        alpha = tl.exp(m - m_ref)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    o_ptrs = out_ptr + i * so_b + h * so_h + offs_t[:, None] * so_t + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=t_mask[:, None])


def ring_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    slot_position: torch.Tensor,
    q_position: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """See the module contract."""
    check_device("ring_attention", q, keys, values, rows, slot_position, q_position)
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        check_dtype(f"ring_attention {name}", t, FLOAT_DTYPES)
        if t.dim() != 4 or t.stride(-1) != 1:
            raise ValueError(f"ring_attention: {name} must be 4-D with a contiguous last dim")
    b, heads, t, d = q.shape
    r, kv_heads, s, dk = keys.shape
    if values.shape != keys.shape or dk != d or heads % kv_heads:
        raise ValueError(
            f"ring_attention: q {tuple(q.shape)} against keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)}: D must agree and H be a multiple of the keys' heads"
        )
    if d != next_pow2(d) or d < 16:
        raise ValueError(f"ring_attention: head dim {d} must be a power of two >= 16")
    if rows.shape != (b,) or slot_position.shape != (r, s) or q_position.shape != (b, t):
        raise ValueError(
            f"ring_attention: rows {tuple(rows.shape)}, slot_position "
            f"{tuple(slot_position.shape)}, q_position {tuple(q_position.shape)} against "
            f"q {tuple(q.shape)} and {r} rings of {s} slots"
        )
    if slot_position.stride(-1) != 1 or q_position.stride(-1) != 1:
        raise ValueError("ring_attention: slot_position and q_position need contiguous rows")
    out = torch.empty((b, heads, t, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_t = max(MIN_BLOCK_T, next_pow2(t))
    ieee = q.dtype == torch.float32 or interpreting()
    _ring_attention_kernel[(b, heads)](
        q, keys, values, rows, slot_position, q_position, out,
        t, s, window, scale,
        *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], slot_position.stride(0),
        q_position.stride(0), *out.stride()[:3],
        GROUPS=heads // kv_heads, D=d, BLOCK_T=block_t, BLOCK_S=BLOCK_S,
        PRECISION="ieee" if ieee else "tf32", num_warps=4,
    )  # fmt: skip
    return out


def ring_attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    slot_position: torch.Tensor,
    q_position: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """The torch form MimiStream runs without the kernel: gather, mask, SDPA (float32)."""
    key_pos = slot_position[rows]  # [b, S]
    gap = q_position[:, :, None] - key_pos[:, None, :]
    seen = (key_pos[:, None, :] >= 0) & (gap >= 0) & (gap < window)
    groups = q.shape[1] // keys.shape[1]
    k = keys[rows].float().repeat_interleave(groups, dim=1)
    v = values[rows].float().repeat_interleave(groups, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # no slot seen: zeros
    return (weights @ v).to(q.dtype)
