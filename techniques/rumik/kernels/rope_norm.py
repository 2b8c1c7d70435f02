"""Decode-step glue kernels: (residual add +) bias-free LayerNorm, and interleaved rotary +
KV-cache write at a device-side position.

Contract
--------
`layer_norm(x[..., N], weight[N], eps=1e-5) -> xn` in x's dtype: Cohere2LayerNorm exactly
(fp32 mean and biased variance, (x - mean) * rsqrt(var + eps) * weight, no bias).
`add_layer_norm(x, residual, weight, eps) -> (xn, s)`: s = x + residual rounded to x's dtype
(what an unfused add stores), xn = layer_norm(s). One read of each input, one launch.
N <= 16384.

`rope_and_cache_write(q[Hq, D], k[Hkv, D], v[Hkv, D], k_cache, v_cache, pos, cos, sin,
rotary=True) -> q_out[Hq, D]`
- pos: a one-element int32/int64 tensor ON THE DEVICE (the new token's position).
- rotary=True: GPT-J / Cohere interleaved rotary on pairs (2i, 2i+1), the convention of
  transformers' Cohere2 (`rotate_half` = stack(-x[1::2], x[::2]) flattened, cos/sin
  repeat_interleave(2)): out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i +
  x[2i] sin_i, in fp32, rounded to the input dtype. cos/sin: [P, D/2] tables from
  `rope_cos_sin` (HF's inv_freq, cos/sin rounded to the model dtype as HF does).
  rotary=False (Cohere2's full-attention layers, which have no positional encoding) copies.
- Writes the (rotated) k and v into k_cache/v_cache ([Hkv, S_max, D] or [1, Hkv, S_max, D]) at
  row pos; a pos outside [0, S_max) writes nothing. q_out may alias q (in place).
- q, k, v may be strided views (e.g. column slices of the packed QKV projection output): only
  the last dim must be contiguous. D even, <= 256; Hq, Hkv <= 64.
- No host synchronisation: CUDA-graph / device-loop safe.

`rope_and_cache_write_rows(q[B, Hq, D], k[B, Hkv, D], v, k_cache[B, Hkv, S_max, D], v_cache,
pos[B], cos, sin, rotary=True) -> q_out[B, Hq, D]`: the same for B rows in one launch (a
batched decode step, techniques/rumik/batched_decode.py), row r at its own device position
pos[r] and into cache row r.

Why it is fast
--------------
At batch 1 these ops move a few KB; their cost is launches and round trips through memory.
LayerNorm (with the residual add of the parallel block fused in) is one program per row with
the whole 2048-wide row in registers. Rotary for all heads of q and k plus both cache writes
is one launch of three programs (q; k; v) that read cos/sin for one position from a
precomputed table (no sin/cos evaluated on the device, so results do not depend on the
GPU's transcendental approximations) and the position from device memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import (
    FLOAT_DTYPES,
    check_cache_rows,
    check_device,
    check_dtype,
    check_kv_scales,
    check_scalar_tensor,
    launch_options,
    next_pow2,
    patch_interpreter_scalars,
    pdl_enabled,
)
from .fp8_rows import e4m3_row

patch_interpreter_scalars()

MAX_NORM_WIDTH = 16384
MAX_HEADS = 64
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------- LayerNorm


@triton.jit
def _layer_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
    stride_x, stride_r, stride_o, stride_s, scale_ptr,
    BLOCK_N: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    m = cols < N
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)  # weights: before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        s = x.to(sum_ptr.dtype.element_ty)  # the residual stream is stored rounded: norm that
        tl.store(sum_ptr + row * stride_s + cols, s, mask=m)
        x = s.to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(m, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    y = xc * tl.rsqrt(var + eps) * w
    if QUANT:  # quantize_rows of the norm as the model's dtype stores it (out is e4m3)
        y, scale = e4m3_row(y.to(x_ptr.dtype.element_ty).to(tl.float32))
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Cohere2LayerNorm: fp32 LayerNorm with weight and no bias, cast back to x's dtype."""
    n = x.shape[-1]
    return F.layer_norm(x.float(), (n,), weight.float(), None, eps).to(x.dtype)


def add_layer_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float() + residual.float()).to(x.dtype)
    return layer_norm_ref(s, weight, eps), s


def _rows(name: str, t: torch.Tensor, n: int) -> torch.Tensor:
    if t.shape[-1] != n:
        raise ValueError(f"{name}: last dim must be {n}, got {t.shape[-1]}")
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
    sum_out: torch.Tensor | None,
    launch_pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    device = check_device("layer_norm", *tensors)
    for t in tensors:
        check_dtype("layer_norm", t, FLOAT_DTYPES)
    n = x.shape[-1]
    if weight.numel() != n or not 1 <= n <= MAX_NORM_WIDTH:
        raise ValueError(f"layer_norm: width must be 1..{MAX_NORM_WIDTH} matching weight, got {n}")
    x2 = _rows("layer_norm x", x, n)
    r2 = x2 if residual is None else _rows("layer_norm residual", residual, n)
    if residual is not None and r2.shape != x2.shape:
        raise ValueError("add_layer_norm: x and residual must have the same shape")
    out = torch.empty_like(x) if out is None else out
    s = None if residual is None else (torch.empty_like(x) if sum_out is None else sum_out)
    for name, t in (("out", out), ("sum_out", s)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()):
            raise ValueError(f"layer_norm: {name} must be contiguous {tuple(x.shape)} {x.dtype}")
    o2 = out.view(-1, n)
    s2 = o2 if s is None else s.view(-1, n)
    use_pdl = pdl_enabled(launch_pdl, device)
    block = next_pow2(n)
    _layer_norm_kernel[(x2.shape[0],)](
        x2, r2, weight.contiguous(), o2, s2, n, float(eps),
        x2.stride(0), r2.stride(0), o2.stride(0), s2.stride(0), o2,
        BLOCK_N=block, HAS_RES=residual is not None, USE_PDL=use_pdl, QUANT=False,
        **launch_options(use_pdl, 4 if block <= 4096 else 8),
    )  # fmt: skip
    return out, s


def layer_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_norm` of each row of x [M, N], quantized as fp8_projections.quantize_rows
    quantizes the norm the model's dtype stores: (e4m3 [M, N], float32 scales [M, 1]). One
    launch, where the norm and then the quantization take two (APPROXIMATE by design: for
    FP8 projections)."""
    check_device("layer_norm_fp8", x, weight)
    for t in (x, weight):
        check_dtype("layer_norm_fp8", t, FLOAT_DTYPES)
    n = x.shape[-1]
    if x.dim() != 2 or weight.numel() != n or not 1 <= n <= MAX_NORM_WIDTH:
        raise ValueError(f"layer_norm_fp8: x must be [M, N], N <= {MAX_NORM_WIDTH}, N = weight")
    x2 = _rows("layer_norm_fp8 x", x, n)
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    block = next_pow2(n)
    _layer_norm_kernel[(x2.shape[0],)](
        x2, x2, weight.contiguous(), q, q, n, float(eps),
        x2.stride(0), x2.stride(0), q.stride(0), q.stride(0), scale,
        BLOCK_N=block, HAS_RES=False, USE_PDL=False, QUANT=True,
        **launch_options(False, 4 if block <= 4096 else 8),
    )  # fmt: skip
    return q, scale


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """Bias-free LayerNorm of each row of x (Cohere2LayerNorm)."""
    return _norm(x, None, weight, eps, out, None, launch_pdl)[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
    launch_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual): the parallel block's residual add + next norm."""
    xn, s = _norm(x, residual, weight, eps, out, sum_out, launch_pdl)
    assert s is not None
    return xn, s


# --------------------------------------------------------------------------- rotary + cache


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, stride_src, stride_dst, cos, sin, n_heads, ok, scale_ptr, stride_scale,
    H_PAD: tl.constexpr, HALF: tl.constexpr, ROTARY: tl.constexpr, QUANT: tl.constexpr,
    INT4: tl.constexpr,
):  # fmt: skip
    """Rotate [n_heads, 2*HALF] rows (pairs 2i, 2i+1) from src into dst (dst may be src).
    QUANT: dst is e4m3 and each row is stored as quantize_rows stores it: rounded to src's
    dtype first (what an unfused write would quantize), its largest |value| mapped to 448,
    its float32 scale written at scale_ptr + head * stride_scale. QUANT and INT4: dst is
    packed INT4 (int4_cache.py: a byte a pair, the largest |value| mapped to 7)."""
    h = tl.arange(0, H_PAD)
    i = tl.arange(0, HALF)
    m = (h < n_heads)[:, None] & ok
    src = src_ptr + h[:, None] * stride_src + 2 * i[None, :]
    even = tl.load(src, mask=m, other=0.0)
    odd = tl.load(src + 1, mask=m, other=0.0)
    if ROTARY:
        e = even.to(tl.float32)
        o = odd.to(tl.float32)
        even = e * cos[None, :] - o * sin[None, :]
        odd = o * cos[None, :] + e * sin[None, :]
    if QUANT and INT4:
        e = even.to(src_ptr.dtype.element_ty).to(tl.float32)
        o = odd.to(src_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(e), axis=1), tl.max(tl.abs(o), axis=1))
        scale = tl.maximum(amax, 1e-12) / 7.0
        # round half to even, as torch.round (int4_cache.py): adding and taking away 1.5 x
        # 2^23 leaves the float32 sum's own rounding, to an integer (|x| <= 7 here)
        n_e = tl.clamp((e / scale[:, None] + 12582912.0) - 12582912.0, -7.0, 7.0)
        n_o = tl.clamp((o / scale[:, None] + 12582912.0) - 12582912.0, -7.0, 7.0)
        packed = (n_e.to(tl.int32) + 8) | ((n_o.to(tl.int32) + 8) << 4)
        tl.store(scale_ptr + h * stride_scale, scale, mask=(h < n_heads) & ok)
        dst = dst_ptr + h[:, None] * stride_dst + i[None, :]
        tl.store(dst, packed.to(tl.uint8), mask=m)
        return
    if QUANT:
        e = even.to(src_ptr.dtype.element_ty).to(tl.float32)
        o = odd.to(src_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(e), axis=1), tl.max(tl.abs(o), axis=1))
        scale = tl.maximum(amax, 1e-12) / 448.0
        even = tl.clamp(e / scale[:, None], -448.0, 448.0)
        odd = tl.clamp(o / scale[:, None], -448.0, 448.0)
        tl.store(scale_ptr + h * stride_scale, scale, mask=(h < n_heads) & ok)
    dst = dst_ptr + h[:, None] * stride_dst + 2 * i[None, :]
    tl.store(dst, even.to(dst_ptr.dtype.element_ty), mask=m)
    tl.store(dst + 1, odd.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr,
    HQ, HKV, S_MAX, TABLE_LEN,
    stride_q, stride_k, stride_v, stride_qo, stride_kch, stride_kcs, stride_vch, stride_vcs,
    stride_qr, stride_kr, stride_vr, stride_qor, stride_kcr, stride_vcr, stride_pos,
    ks_ptr, vs_ptr, stride_sr, stride_sh, rows_ptr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, HALF: tl.constexpr,
    ROTARY: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr, ROW_MAP: tl.constexpr,
    KV_INT4: tl.constexpr,
):  # fmt: skip
    # KV_FP8: quantized caches with scales, e4m3 or (KV_INT4) packed INT4.
    # Three programs per row, one per tensor (q; k into the cache; v into the cache), each
    # with one dependent chain (position -> cos/sin -> rotate -> store). Measured neutral
    # against one program doing the three in turn (3.51 against 3.57 us per call inside
    # exp74-full on the H200): under PDL the call's time is mostly its wait on the GEMV
    # before it. One stream's step is one row (row strides unused); a batched step's rows
    # each read their own position (ROW_MAP: and write the cache row the map gives them).
    part = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    cache_row = row
    if ROW_MAP:
        cache_row = tl.load(rows_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row * stride_pos).to(tl.int64)
    cos = tl.zeros([HALF], dtype=tl.float32)
    sin = tl.zeros([HALF], dtype=tl.float32)
    if ROTARY:  # (the v program reads the 256 bytes too and never uses them)
        in_table = (pos >= 0) & (pos < TABLE_LEN)
        cos = tl.load(cos_ptr + pos * HALF + i, mask=in_table, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF + i, mask=in_table, other=0.0).to(tl.float32)
    in_cache = (pos >= 0) & (pos < S_MAX)  # never write outside the cache
    scales = cache_row * stride_sr + pos  # KV_FP8: the row's scales at pos, one per kv head
    if part == 0:
        _rotate_heads(q_ptr + row * stride_qr, q_out_ptr + row * stride_qor, stride_q,
                      stride_qo, cos, sin, HQ, True, ks_ptr, 0, HQ_PAD, HALF, ROTARY,
                      False, False)  # fmt: skip
    elif part == 1:
        _rotate_heads(k_ptr + row * stride_kr,
                      kc_ptr + cache_row * stride_kcr + pos * stride_kcs,
                      stride_k, stride_kch, cos, sin, HKV, in_cache, ks_ptr + scales,
                      stride_sh, HKV_PAD, HALF, ROTARY, KV_FP8, KV_INT4)  # fmt: skip
    else:
        _rotate_heads(v_ptr + row * stride_vr,
                      vc_ptr + cache_row * stride_vcr + pos * stride_vcs,
                      stride_v, stride_vch, cos, sin, HKV, in_cache, vs_ptr + scales,
                      stride_sh, HKV_PAD, HALF, False, KV_FP8, KV_INT4)  # fmt: skip


def rope_cos_sin(
    max_positions: int,
    head_dim: int = 128,
    theta: float = 50000.0,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim // 2] as transformers' Cohere2RotaryEmbedding
    computes them (fp32 angles, then rounded to the model dtype); one value per pair."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    inv_freq = inv_freq.to(device)
    pos = torch.arange(max_positions, device=device, dtype=torch.float)
    freqs = pos[:, None] * inv_freq[None, :]
    return freqs.cos().to(dtype).contiguous(), freqs.sin().to(dtype).contiguous()


def rotary_ref(x: torch.Tensor, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Cohere2 interleaved rotary for rows x[..., D] at one position."""
    c = cos[pos].float().repeat_interleave(2)
    s = sin[pos].float().repeat_interleave(2)
    xf = x.float()
    rot = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
    return (xf * c + rot * s).to(x.dtype)


def rope_and_cache_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int | torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary: bool = True,
) -> torch.Tensor:
    """Reference: returns q_out and writes k/v into the caches (in place), like the kernel."""
    p = int(pos.item()) if isinstance(pos, torch.Tensor) else int(pos)
    q_out = rotary_ref(q, p, cos, sin) if rotary else q.clone()
    k_new = rotary_ref(k, p, cos, sin) if rotary else k
    kc, vc = _as_3d(k_cache), _as_3d(v_cache)
    if 0 <= p < kc.shape[1]:
        kc[:, p] = k_new.to(kc.dtype)
        vc[:, p] = v.to(vc.dtype)
    return q_out


def _as_3d(cache: torch.Tensor) -> torch.Tensor:
    if cache.dim() == 4 and cache.shape[0] == 1:
        cache = cache[0]
    if cache.dim() != 3:
        raise ValueError(f"cache must be [Hkv, S_max, D] or [1, Hkv, S_max, D], got {cache.shape}")
    return cache


def _heads(name: str, t: torch.Tensor, d: int) -> torch.Tensor:
    t2 = t.reshape(-1, d) if t.dim() != 2 else t
    if t2.stride(-1) != 1:
        raise ValueError(f"rope_and_cache_write: {name} must have a contiguous last dim")
    return t2


def _check_rope(
    q: torch.Tensor, k: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor
) -> None:
    d = q.shape[-1]
    if d % 2 or d > MAX_HEAD_DIM or k.shape[-1] != d or kc.shape[-1] != d:
        raise ValueError(f"rope_and_cache_write: head_dim must be even, <= {MAX_HEAD_DIM}, equal")
    if d & (d - 1):
        raise ValueError(f"rope_and_cache_write: head_dim must be a power of two, got {d}")
    if q.shape[0] > MAX_HEADS or k.shape[0] > MAX_HEADS:
        raise ValueError(f"rope_and_cache_write: at most {MAX_HEADS} heads")
    if kc.shape != vc.shape or kc.shape[0] != k.shape[0]:
        raise ValueError("rope_and_cache_write: caches must be [Hkv, S_max, D] matching k")
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        raise ValueError("rope_and_cache_write: caches must have a contiguous last dim")
    if cos.dim() != 2 or cos.shape[1] != d // 2 or not cos.is_contiguous():
        raise ValueError(f"rope_and_cache_write: cos/sin must be contiguous [P, {d // 2}]")


def rope_and_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary: bool = True,
    q_out: torch.Tensor | None = None,
    launch_pdl: bool = False,
) -> torch.Tensor:
    """Rotate q and k at the device position `pos`; write k, v into the caches at `pos`."""
    kc, vc = _as_3d(k_cache), _as_3d(v_cache)
    d = kc.shape[-1]
    q2, k2, v2 = _heads("q", q, d), _heads("k", k, d), _heads("v", v, d)
    device = check_device("rope_and_cache_write", q2, k2, v2, kc, vc, cos, sin)
    check_scalar_tensor("rope_and_cache_write pos", pos, device)
    for t in (q2, k2, v2, kc, vc, cos, sin):
        check_dtype("rope_and_cache_write", t, FLOAT_DTYPES)
    _check_rope(q2, k2, kc, vc, cos)
    if v2.shape != k2.shape or sin.shape != cos.shape:
        raise ValueError("rope_and_cache_write: v must match k, sin must match cos")
    if q_out is None:
        q_out = torch.empty_like(q2)
    elif q_out.numel() != q2.numel() or q_out.dtype != q2.dtype:
        raise ValueError("rope_and_cache_write: q_out must match q in size and dtype")
    qo = q_out.view(q2.shape)
    use_pdl = pdl_enabled(launch_pdl, device)
    _rope_cache_kernel[(3, 1)](
        q2, k2, v2, pos, cos, sin, qo, kc, vc,
        q2.shape[0], k2.shape[0], kc.shape[1], cos.shape[0],
        q2.stride(0), k2.stride(0), v2.stride(0), qo.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        0, 0, 0, 0, 0, 0, 0,  # one row
        kc, vc, 0, 0, pos,  # no scales (a cache in the model's dtype), no row map
        HQ_PAD=next_pow2(max(2, q2.shape[0])), HKV_PAD=next_pow2(max(2, k2.shape[0])),
        HALF=d // 2, ROTARY=bool(rotary), USE_PDL=use_pdl, KV_FP8=False, ROW_MAP=False,
        KV_INT4=False,
        **launch_options(use_pdl, 4),
    )  # fmt: skip
    return q_out


def rope_and_cache_write_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary: bool = True,
    q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    cache_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rope_and_cache_write` for B rows at once: row r's q [B, Hq, D] and k [B, Hkv, D]
    rotated at its own device position pos[r], its k and v written into cache row r
    ([B, Hkv, S_max, D]) at pos[r]. One launch of 3 x B programs. With e4m3 caches and
    their float32 scales [B, Hkv, S_max] (batched_decode's `kv: fp8`), each key and value
    vector is written as quantize_rows writes it, its scale beside it. `cache_rows` [B]
    (on the device): row r writes cache row cache_rows[r] of caches of any number of rows
    (a prompt's tokens, each at its own position). A position outside [0, S_max) writes
    nothing (its q is still rotated, with cos 1 and sin 0 outside the table)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            "rope_and_cache_write_rows: q, k, v must be [B, H, D] and the caches "
            f"[B, Hkv, S_max, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(k_cache.shape)}"
        )
    b, d = q.shape[0], q.shape[-1]
    cache_b = b if cache_rows is None else k_cache.shape[0]
    if k.shape[0] != b or v.shape != k.shape or k_cache.shape[0] != cache_b:
        raise ValueError(f"rope_and_cache_write_rows: q, k, v and the caches need {b} rows")
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ValueError("rope_and_cache_write_rows: k_cache and v_cache differ in rows")
    if cache_rows is not None:
        check_cache_rows("rope_and_cache_write_rows", cache_rows, b, q.device)
    if pos.shape != (b,) or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_and_cache_write_rows: pos must be [{b}] int32 or int64")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_and_cache_write_rows: {name} must have a contiguous last dim")
    check_device("rope_and_cache_write_rows", q, k, v, k_cache, v_cache, pos, cos, sin)
    fp8 = _check_fp8_scales(k_cache, v_cache, k_scale, v_scale)  # None, "fp8" or "int4"
    for t in (q, k, v, cos, sin) if fp8 else (q, k, v, k_cache, v_cache, cos, sin):
        check_dtype("rope_and_cache_write_rows", t, FLOAT_DTYPES)
    if fp8 == "int4":  # two values a byte: the shapes checked as the unpacked cache's
        if k_cache.shape[-1] * 2 != d or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"rope_and_cache_write_rows: packed INT4 caches hold {d // 2} bytes a position"
            )
        kc0 = torch.empty((*k_cache.shape[1:3], d), dtype=q.dtype, device="meta")
        _check_rope(q[0], k[0], kc0, kc0, cos)
    else:
        _check_rope(q[0], k[0], k_cache[0], v_cache[0], cos)
    if sin.shape != cos.shape:
        raise ValueError("rope_and_cache_write_rows: sin must match cos")
    if q_out is None:
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"rope_and_cache_write_rows: q_out must be {tuple(q.shape)} {q.dtype}")
    kc, vc = k_cache, v_cache
    _rope_cache_kernel[(3, b)](
        q, k, v, pos, cos, sin, q_out, kc, vc,
        q.shape[1], k.shape[1], kc.shape[2], cos.shape[0],
        q.stride(1), k.stride(1), v.stride(1), q_out.stride(1),
        kc.stride(1), kc.stride(2), vc.stride(1), vc.stride(2),
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0),
        kc.stride(0), vc.stride(0), pos.stride(0),
        k_scale if fp8 else kc, v_scale if fp8 else vc,  # unread unless fp8
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        cache_rows if cache_rows is not None else pos,  # unread without a map
        HQ_PAD=next_pow2(max(2, q.shape[1])), HKV_PAD=next_pow2(max(2, k.shape[1])),
        HALF=d // 2, ROTARY=bool(rotary), USE_PDL=False, KV_FP8=fp8 is not None,
        KV_INT4=fp8 == "int4",
        ROW_MAP=cache_rows is not None,
        **launch_options(False, 4),
    )  # fmt: skip
    return q_out


def _check_fp8_scales(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> str | None:
    """ "fp8" for e4m3 caches with their scales, "int4" for packed INT4 (uint8) caches with
    theirs (checked), None for caches without."""
    fp8 = torch.float8_e4m3fn
    name = "rope_and_cache_write_rows"
    if not check_kv_scales(name, k_cache, k_scale, v_scale):
        if k_cache.dtype in (fp8, torch.uint8) or v_cache.dtype in (fp8, torch.uint8):
            raise ValueError(f"{name}: e4m3 and packed INT4 caches need k_scale and v_scale")
        return None
    for kind, dtype in (("fp8", fp8), ("int4", torch.uint8)):
        if k_cache.dtype == dtype and v_cache.dtype == dtype:
            return kind
    raise ValueError(f"{name}: scales go with float8_e4m3fn or uint8 (packed INT4) caches")


def rope_and_cache_write_rows_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    rotary: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: `rope_and_cache_write_ref` row by row; with scales, each key and value
    vector quantized as quantize_rows does (largest |value| -> 448, float32 scale), or into
    a uint8 cache as int4_cache.quantize_int4 does."""
    from .int4_cache import quantize_int4

    if k_scale is None or v_scale is None:
        return torch.stack([
            rope_and_cache_write_ref(
                q[r], k[r], v[r], k_cache[r], v_cache[r], p, cos, sin, rotary=rotary
            )
            for r, p in enumerate(pos)
        ])  # fmt: skip
    out = []
    for r, p in enumerate(pos):
        out.append(rotary_ref(q[r], p, cos, sin) if rotary else q[r].clone())
        k_new = rotary_ref(k[r], p, cos, sin) if rotary else k[r]
        for cache, scales, x in ((k_cache, k_scale, k_new), (v_cache, v_scale, v[r])):
            if cache.dtype == torch.uint8:  # packed INT4 (int4_cache.py)
                cache[r, :, p], scales[r, :, p] = quantize_int4(x)
                continue
            scale = x.abs().amax(-1).float().clamp(min=1e-12) / 448.0
            cache[r, :, p] = (x.float() / scale[:, None]).clamp(-448.0, 448.0).to(cache.dtype)
            scales[r, :, p] = scale
    return torch.stack(out)
