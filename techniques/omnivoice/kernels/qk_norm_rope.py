"""Qwen3's per-head q/k RMSNorm and rotary in one launch, from the packed q|k|v projection.

Contract
--------
`qk_norm_rope(qkv[B, S, N], q_weight[D], k_weight[D], cos[Bc, S, D], sin, eps, hq, hkv)
-> (q[B, hq, S, D], k[B, hkv, S, D])`, both contiguous, in qkv's dtype:
- q = rotary(rmsnorm(qkv[..., :hq*D] as heads)), k the same from the next hkv*D columns
  (v, after them, is not read). qkv's last dim must be contiguous; N >= (hq + hkv) * D.
- rmsnorm is Qwen3RMSNorm: fp32 mean of squares, x * rsqrt(mean + eps) rounded to the input
  dtype, times the weight (rounded again). rotary is transformers' `apply_rotary_pos_emb`
  (rotate_half: out[:D/2] = y1 cos1 - y2 sin1, out[D/2:] = y2 cos2 + y1 sin2), each product
  and the sum rounded to the input dtype as eager bf16 arithmetic rounds them: for a bf16
  model the result is eager's up to the fp32 summation order of the mean (the interpreter
  also truncates where the GPU rounds to nearest).
- cos/sin: the rotary embedding's [Bc, S, D] tables in the input dtype; Bc is 1 or B.
- D even, <= 256; hq, hkv <= 64. No host synchronisation (CUDA-graph safe).

`qkv_norm_rope(...same arguments...) -> (q, k, v)`, each [B, hq, S, D]: q and k as above, v
the next hkv*D columns as heads, and k and v repeated to hq heads as transformers' repeat_kv
does (kv head j serves q heads j*r .. j*r + r - 1, r = hq / hkv; hq must be a multiple of hkv;
N >= (hq + 2 hkv) * D). Attention then reads three [B, hq, S, D] tensors with no GQA step.
They come back tokens-major: contiguous [B, S, hq, D], which the caller transposes to
[B, hq, S, D] views for attention. SDPA's cuDNN and flash paths write their output in q's
layout, so attention's output is then already [B, S, hq * D] memory for o_proj, with no
copy. With tokens_major=False it returns contiguous [B, hq, S, D] instead.

Why
---
ov_packed_projections leaves this to inductor, which fuses it into a reduction kernel of
5.8 us a layer reading strided columns of the packed output
(benchmarks/h200/issue14-ov-packed-profile.json), then SDPA's layout copies. Here one
program per token reads its q and k heads once and writes them in the [B, H, S, D] layout
attention reads. With a mask (OmniVoice's CFG padding), transformers' SDPA path expands k and
v to the q heads (repeat_kv: two copy kernels a layer,
benchmarks/h200/issue14-ov-fused-profile.json); `qkv_norm_rope` writes that layout in the same
launch, and tokens-major so that attention's output needs no copy back (heads-major, it
costs a 1.40 us clone a layer: benchmarks/h200/issue14-ov-qkv-v3-profile.json).
`qk_norm_rope_op` is the same launch as a torch.library triton_op, so torch.compile keeps it
inside its graph instead of breaking the graph around an opaque call.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from orchestrate.api.device import interpreting

MAX_HEADS = 64
MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x rounded to the model dtype and back: eager arithmetic's rounding after each op."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _heads(
    row_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, s, SH, SS, eps,
    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, DTYPE: tl.constexpr, REP: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < H)[:, None] & (offs_d < HALF)[None, :]
    lo = offs_h[:, None] * D + offs_d[None, :]
    x1 = tl.load(row_ptr + lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + lo + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
    d_mask = offs_d < HALF
    w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    y1 = _round(w1[None, :] * _round(x1 * inv[:, None], DTYPE), DTYPE)
    y2 = _round(w2[None, :] * _round(x2 * inv[:, None], DTYPE), DTYPE)
    c1 = tl.load(cos_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    o1 = _round(y1 * c1, DTYPE) + _round(-y2 * s1, DTYPE)
    o2 = _round(y2 * c2, DTYPE) + _round(y1 * s2, DTYPE)
    # out[b, h * REP + r, s, :] for each copy r: out_ptr points at [b, 0, 0, 0], SH and SS
    # are the head and token strides (heads-major [B, H, S, D] or tokens-major [B, S, H, D])
    for r in tl.static_range(REP):
        dst = out_ptr + (offs_h[:, None] * REP + r) * SH + s * SS + offs_d[None, :]
        tl.store(dst, o1.to(DTYPE), mask=mask)
        tl.store(dst + HALF, o2.to(DTYPE), mask=mask)


@triton.jit
def _copy_heads(
    row_ptr, out_ptr, s, SH, SS,
    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    REP: tl.constexpr,
):  # fmt: skip
    """v: row[h * D + d] to out[b, h * REP + r, s, d] for each copy r, unchanged."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    x = tl.load(row_ptr + offs_h[:, None] * D + offs_d[None, :], mask=mask)
    for r in tl.static_range(REP):
        dst = out_ptr + (offs_h[:, None] * REP + r) * SH + s * SS + offs_d[None, :]
        tl.store(dst, x, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
    S, stride_qkv_b, stride_qkv_s, stride_cos_b, eps,
    HQ: tl.constexpr, HQ_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
    D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, DTYPE: tl.constexpr,
    WITH_V: tl.constexpr, REP: tl.constexpr, TOKENS_MAJOR: tl.constexpr,
):  # fmt: skip
    """One program per (b, s): q, and k written REP times (HKV * REP heads); with WITH_V,
    v too, also REP times. Without it REP is 1 and v is not read. TOKENS_MAJOR (only with
    WITH_V, where every output has HQ heads): outputs laid out [B, S, HQ, D] in memory."""
    # Under torch.compile a Python float argument arrives as fp64; left so, it promotes the
    # norm to fp64, whose one rounding to bf16 differs from eager's fp32-then-bf16 in the
    # last bit now and then (on the H200, k came out 1 ulp apart, compiled against eager:
    # benchmarks/h200/issue14-qk-compile-diag.log)
    eps = tl.cast(eps, tl.float32)
    b = tl.program_id(0) // S
    s = tl.program_id(0) % S
    row = qkv_ptr + b.to(tl.int64) * stride_qkv_b + s.to(tl.int64) * stride_qkv_s
    table = b.to(tl.int64) * stride_cos_b + s * D
    q_out = q_ptr + b.to(tl.int64) * HQ * S * D
    kv_size = b.to(tl.int64) * HKV * REP * S * D
    if TOKENS_MAJOR:
        SH = D
        SS = HQ * D
    else:
        SH = S * D
        SS = D
    _heads(row, q_out, qw_ptr, cos_ptr + table, sin_ptr + table, s, SH, SS, eps,
           HQ, HQ_PAD, D, HALF, HALF_PAD, DTYPE, 1)  # fmt: skip
    _heads(row + HQ * D, k_ptr + kv_size, kw_ptr, cos_ptr + table, sin_ptr + table, s, SH,
           SS, eps, HKV, HKV_PAD, D, HALF, HALF_PAD, DTYPE, REP)  # fmt: skip
    if WITH_V:
        _copy_heads(row + (HQ + HKV) * D, v_ptr + kv_size, s, SH, SS, HKV, HKV_PAD, D,
                    2 * HALF_PAD, REP)  # fmt: skip


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _check(qkv, q_weight, k_weight, cos, sin, hq: int, hkv: int, with_v: bool) -> int:
    """Raise on anything the kernel would read wrongly; returns the head dim."""
    d = q_weight.numel()
    heads_read = hq + 2 * hkv if with_v else hq + hkv
    if qkv.dim() != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope: qkv must be [B, S, N] with a contiguous last dim, "
                         f"got {tuple(qkv.shape)}")  # fmt: skip
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qk_norm_rope: qkv dtype must be one of {DTYPES}, got {qkv.dtype}")
    if q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype:  # eager would upcast
        raise ValueError(f"qk_norm_rope: norm weights must be {qkv.dtype}, got "
                         f"{q_weight.dtype} and {k_weight.dtype}")  # fmt: skip
    if d % 2 or d > MAX_HEAD_DIM or k_weight.numel() != d:
        raise ValueError(f"qk_norm_rope: head dim {d} (k weight {k_weight.numel()}) must be "
                         f"even, equal, <= {MAX_HEAD_DIM}")  # fmt: skip
    if not (0 < hq <= MAX_HEADS and 0 < hkv <= MAX_HEADS) or qkv.shape[-1] < heads_read * d:
        raise ValueError(f"qk_norm_rope: {hq} q + {hkv} kv heads of {d} do not fit "
                         f"{qkv.shape[-1]} columns (at most {MAX_HEADS} heads each)")  # fmt: skip
    if with_v and hq % hkv:
        raise ValueError(f"qkv_norm_rope: {hq} q heads are not a multiple of {hkv} kv heads")
    b, s = qkv.shape[:2]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[0] not in (1, b) or tuple(t.shape[1:]) != (s, d) or not t.is_contiguous():
            raise ValueError(f"qk_norm_rope: {name} must be contiguous [1 or {b}, {s}, {d}], "
                             f"got {tuple(t.shape)}")  # fmt: skip
    if cos.shape != sin.shape:
        raise ValueError("qk_norm_rope: cos and sin differ in shape")
    tensors = (qkv, q_weight, k_weight, cos, sin)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("qk_norm_rope: tensors on different devices")
    if qkv.device.type != "cuda" and not interpreting():
        raise ValueError(f"qk_norm_rope: needs CUDA (or TRITON_INTERPRET=1), got {qkv.device}")
    return d


def _launch(kernel, qkv, q_weight, k_weight, cos, sin, eps: float, hq: int, hkv: int,
            with_v: bool = False, tokens_major: bool = False, num_warps: int = 4):  # fmt: skip
    d = _check(qkv, q_weight, k_weight, cos, sin, hq, hkv, with_v)
    if tokens_major and not with_v:
        raise ValueError("qk_norm_rope: the tokens-major layout is the qkv form's (q, k, v)")
    b, s = qkv.shape[:2]

    def heads(n: int) -> torch.Tensor:
        # Tokens-major outputs go back as the contiguous [b, s, n, d] tensors the kernel
        # wrote, not as transposed views: under torch.compile a triton_op's outputs that are
        # views are cloned around the launch (about 3 copy kernels a layer more:
        # benchmarks/h200/issue14-ov-qkv-v4-profile.json)
        shape = (b, s, n, d) if tokens_major else (b, n, s, d)
        return torch.empty(shape, dtype=qkv.dtype, device=qkv.device)

    q = heads(hq)
    k = heads(hq if with_v else hkv)
    v = heads(hq) if with_v else q  # q: an unused pointer when v is not written
    out = (q, k, v) if with_v else (q, k)
    if b * s == 0:
        return out
    half = d // 2
    kernel[(b * s,)](
        qkv, q_weight.contiguous(), k_weight.contiguous(), cos, sin, q, k, v,
        s, qkv.stride(0), qkv.stride(1), 0 if cos.shape[0] == 1 else cos.stride(0), eps,
        HQ=hq, HQ_PAD=triton.next_power_of_2(hq), HKV=hkv, HKV_PAD=triton.next_power_of_2(hkv),
        D=d, HALF=half, HALF_PAD=triton.next_power_of_2(half), DTYPE=_TL[qkv.dtype],
        WITH_V=with_v, REP=hq // hkv if with_v else 1, TOKENS_MAJOR=tokens_major,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract above, as a plain launch (eager code and the interpreter)."""
    return _launch(_qk_norm_rope_kernel, qkv, q_weight, k_weight, cos, sin, eps, hq, hkv)


def qkv_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    hq: int,
    hkv: int,
    tokens_major: bool = True,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract's second form: q, k and v, k and v repeated to hq heads, each a
    contiguous [B, S, hq, D] (tokens-major: transpose(1, 2) for attention); with
    tokens_major=False each a contiguous [B, hq, S, D] (heads-major, the layout before
    tokens-major; kept for A/Bs).
    num_warps: launch shape only (benchmarks/ov_qkv_warps.py times the others; the norm's
    sums reduce across warps, so another count may round differently)."""
    return _launch(_qk_norm_rope_kernel, qkv, q_weight, k_weight, cos, sin, eps, hq, hkv,
                   True, tokens_major, num_warps)  # fmt: skip


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3 path: q_norm/k_norm per head, transpose, apply_rotary_pos_emb."""
    d = q_weight.numel()
    b, s = qkv.shape[:2]

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)

    q = norm(qkv[..., : hq * d].reshape(b, s, hq, d), q_weight).transpose(1, 2)
    k = norm(qkv[..., hq * d : (hq + hkv) * d].reshape(b, s, hkv, d), k_weight).transpose(1, 2)
    c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * c) + (rotate_half(q) * sn), (k * c) + (rotate_half(k) * sn)


def qkv_norm_rope_ref(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    hq: int,
    hkv: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qk_norm_rope_ref, then v's columns as heads and transformers' repeat_kv of k and v."""
    from transformers.integrations.sdpa_attention import repeat_kv

    d = q_weight.numel()
    b, s = qkv.shape[:2]
    q, k = qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, eps, hq, hkv)
    v = qkv[..., (hq + hkv) * d : (hq + 2 * hkv) * d].reshape(b, s, hkv, d).transpose(1, 2)
    return q, repeat_kv(k, hq // hkv), repeat_kv(v, hq // hkv)


# The ops' arguments, for the schema torch.library infers (annotations as objects: one body
# serves both forms, which differ only in how many tensors they return).
_OP_ARGS = {
    **dict.fromkeys(("qkv", "q_weight", "k_weight", "cos", "sin"), torch.Tensor),
    **{"eps": float, "hq": int, "hkv": int},
}


@functools.cache
def _op(with_v: bool, tokens_major: bool = False):
    from torch.library import triton_op, wrap_triton

    def launch(qkv, q_weight, k_weight, cos, sin, eps, hq, hkv):
        kernel = wrap_triton(_qk_norm_rope_kernel)
        return _launch(kernel, qkv, q_weight, k_weight, cos, sin, eps, hq, hkv, with_v,
                       tokens_major)  # fmt: skip

    launch.__annotations__ = {**_OP_ARGS, "return": tuple[(torch.Tensor,) * (3 if with_v else 2)]}
    name = "ov_qkv_norm_rope" if with_v else "ov_qk_norm_rope"
    name += "" if tokens_major or not with_v else "_heads_major"
    return triton_op(f"orchestrate::{name}", mutates_args=())(launch)


def qk_norm_rope_op():
    """The launch as `torch.ops.orchestrate.ov_qk_norm_rope`, registered on first use: a
    torch.library triton_op, which torch.compile traces into its graph (its fake version, for
    shapes, is the same function with the launch skipped)."""
    return _op(False)


def qkv_norm_rope_op(tokens_major: bool = True):
    """`qkv_norm_rope` as `torch.ops.orchestrate.ov_qkv_norm_rope` (see qk_norm_rope_op);
    tokens_major=False: its heads-major form as `..._heads_major`."""
    return _op(True, tokens_major)
