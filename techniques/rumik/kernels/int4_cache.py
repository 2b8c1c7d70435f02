"""The packed INT4 KV-cache layout (APPROXIMATE by design), in torch: its writer and reader.

Layout
------
A cache of uint8 [..., S_max, D // 2] with float32 scales [..., S_max]: position p's vector
x (D values of one head) is stored as round(x / scale) in [-7, 7] with scale = max|x| / 7,
each value offset by 8 into a nibble; byte j holds element 2j in its low nibble and element
2j + 1 in its high nibble (the interleaved rotary's pairs, so a kernel that rotates pairs
writes a byte per pair). Quantized in float32, rounding half to even (torch.round).

Why
---
A loaded serving step's attention reads every live row's keys and values once per layer;
with the FP8 cache that is 2 x D bytes a position and head. This layout halves them.
kernels/batched_attention.py reads it, rope_norm.rope_and_cache_write_rows writes it
(batched_decode `kv: int4`); these torch functions are the reference and the torch glue's
writer. Measured slower than FP8 on an H100: the reader is bound by unpacking
(benchmarks/h100/serving/batched-attention-int4.json, README "Half the cache's bytes").
"""

from __future__ import annotations

import torch

INT4_MAX = 7  # symmetric: [-7, 7], so -x quantizes to the negation of x


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed uint8 [..., D // 2], float32 scales [...])."""
    if x.shape[-1] % 2:
        raise ValueError(f"quantize_int4: the last dim must be even, got {x.shape[-1]}")
    xf = x.float()
    scale = xf.abs().amax(-1).clamp(min=1e-12) / INT4_MAX
    q = torch.round(xf / scale[..., None])  # half to even, as torch rounds
    q = q.clamp(-INT4_MAX, INT4_MAX).to(torch.int16) + 8
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed.to(torch.uint8), scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., D // 2] -> the integers [..., D] (float32, in [-8, 7])."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: a uint8 cache, got {packed.dtype}")
    p = packed.to(torch.int16)
    pairs = torch.stack([(p & 15) - 8, (p >> 4) - 8], dim=-1)
    return pairs.flatten(-2).float()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The values a reader sees: unpack_int4(packed) * scale, float32 [..., D]."""
    return unpack_int4(packed) * scale[..., None]
