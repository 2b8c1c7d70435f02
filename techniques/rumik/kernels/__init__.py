"""Triton kernels for the Rumik OSS 1 batch-1 decode step (Hopper), each beside its torch
reference:

- int8_gemv: weight-only INT8 GEMV (quantize_int8, int8_linear, tune_int8_linear)
- int6_gemv: weight-only INT6 GEMV, 4 weights in 3 bytes (quantize_int6, int6_linear)
- decode_attention: GQA flash-decoding with a device-side length (decode_attention)
- sampler: fused top-k sampler with a device-side Philox counter (sample_top_k)
- rope_norm: (residual add +) LayerNorm, interleaved rotary + KV-cache write
- swiglu: silu(gate) * up written beside attn, the packed o+down input (swiglu_cat), or
  for a batched step's rows (swiglu_rows)
- batched_attention: decode attention for many rows, each over its own length
- fp8_rows: each activation row to e4m3 with its own scale, one launch (quantize_rows_fp8)
- ring_attention: a streaming codec's attention over each row's ring, read in place
- epilogue: the GEMVs' shared per-channel scale + split-K epilogue (store_scaled) and its
  semaphore pool (split_k_semaphores)

Submodules import Triton; this package does not, so importing it is cheap.
Names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "quantize_int8": "int8_gemv",
    "int8_linear": "int8_gemv",
    "int8_linear_ref": "int8_gemv",
    "tune_int8_linear": "int8_gemv",
    "GemvConfig": "int8_gemv",
    "quantize_int6": "int6_gemv",
    "int6_linear": "int6_gemv",
    "int6_linear_ref": "int6_gemv",
    "tune_int6_linear": "int6_gemv",
    "Int6Config": "int6_gemv",
    "decode_attention": "decode_attention",
    "decode_attention_ref": "decode_attention",
    "sample_top_k": "sampler",
    "sample_top_k_ref": "sampler",
    "top_k_probs_ref": "sampler",
    "layer_norm": "rope_norm",
    "add_layer_norm": "rope_norm",
    "rope_cos_sin": "rope_norm",
    "rope_and_cache_write": "rope_norm",
    "swiglu_cat": "swiglu",
    "swiglu_cat_ref": "swiglu",
    "swiglu_rows": "swiglu",
    "rope_and_cache_write_rows": "rope_norm",
    "batched_decode_attention": "batched_attention",
    "quantize_rows_fp8": "fp8_rows",
    "ring_attention": "ring_attention",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
