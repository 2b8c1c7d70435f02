"""INT6 weight-only decode projections (APPROXIMATE), packed as in packed_projections.

The seed's negative result, built honestly: weights quantised per output channel to 6 bits
(scale = absmax / 31), four weights stored in three bytes, and a Triton GEMV that unpacks them
in registers (techniques/rumik/kernels/int6_gemv.py). It reads 25% fewer weight bytes than
int8_projections but spends about twice the ALU work per byte unpacking; the benchmark
decides which wins. Decode steps (one row) use the kernel; prefill multiplies by the
dequantised weights, so it sees the same rounded weights. 6-bit rounding moves the logits
about four times as far as INT8: fidelity and quality gates report by how much.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams, UnsupportedConfig
from orchestrate.families.rumik.engine import Engine
from orchestrate.techniques.rumik.int8_projections import QuantizedPacked


class Int6Params(TechniqueParams):
    pdl: bool = Field(False, description="Programmatic dependent launch (Hopper).")


class Int6Packed(QuantizedPacked):
    max_gemv_rows = 1  # the int6 kernel is a one-row GEMV

    def check(self, cfg: Any) -> None:
        out_k = cfg.num_attention_heads * cfg.head_dim + cfg.intermediate_size
        for name, k in (("hidden_size", cfg.hidden_size), ("heads*head_dim+intermediate", out_k)):
            if k % 4:
                raise UnsupportedConfig(
                    f"int6_projections packs 4 weights in 3 bytes: {name} must be a multiple "
                    f"of 4, this model has {k}"
                )

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from orchestrate.techniques.rumik.kernels.int6_gemv import quantize_int6

        return quantize_int6(w)

    def gemv(self, rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        from orchestrate.techniques.rumik.kernels.int6_gemv import int6_linear

        return int6_linear(rows, q, scale, launch_pdl=self.launch_pdl)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from orchestrate.techniques.rumik.kernels.int6_gemv import dequantize_int6

        return dequantize_int6(q, scale, dtype=dtype)


class Int6Projections(Technique):
    name = "int6_projections"
    family = "rumik"
    exact = False
    slots = ("projections",)
    requires = ("cuda", "package:triton")
    after = ("static_kv_cache",)
    conflicts = ("int8_projections",)
    summary = "APPROXIMATE: int6 (4 in 3 bytes) weight-only packed projections, Triton GEMV."
    Params = Int6Params

    def apply(self, engine: Engine) -> None:
        engine.projections = Int6Packed(engine, self.params.pdl)  # type: ignore[attr-defined]
