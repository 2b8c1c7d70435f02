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

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrator.families.rumik.engine import Engine, tensor_bytes
from orchestrator.technique import Technique, TechniqueParams


class Int6Params(TechniqueParams):
    pdl: bool = Field(False, description="Programmatic dependent launch (Hopper).")


class Int6Packed:
    def __init__(self, engine: Engine, pdl: bool):
        from techniques.rumik.kernels.int6_gemv import quantize_int6

        self.pdl = pdl
        self.w_in: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.w_out: list[tuple[torch.Tensor, torch.Tensor]] = []
        cfg = engine.model.config
        out_k = cfg.num_attention_heads * cfg.head_dim + cfg.intermediate_size
        for name, k in (("hidden_size", cfg.hidden_size), ("heads*head_dim+intermediate", out_k)):
            if k % 4:
                raise ValueError(
                    f"int6_projections packs 4 weights in 3 bytes: {name} must be a multiple "
                    f"of 4, this model has {k}"
                )
        for layer in engine.model.lm.model.layers:
            a, m = layer.self_attn, layer.mlp
            parts = [a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj]
            w_in = torch.cat([p.weight for p in parts])
            self.w_in.append(quantize_int6(w_in))
            self.w_out.append(quantize_int6(torch.cat([a.o_proj.weight, m.down_proj.weight], 1)))
            del w_in
        first = engine.model.lm.model.layers[0]
        a, m = first.self_attn, first.mlp
        self.sizes = [
            a.q_proj.out_features,
            a.k_proj.out_features,
            a.v_proj.out_features,
            m.gate_proj.out_features,
            m.up_proj.out_features,
        ]

    def _linear(self, x: torch.Tensor, qs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        from techniques.rumik.kernels.int6_gemv import dequantize_int6, int6_linear

        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            y = int6_linear(rows, *qs, launch_pdl=self.pdl)
        else:  # prefill: once per utterance, the same rounded weights
            y = F.linear(rows, dequantize_int6(*qs, dtype=x.dtype))
        return y.view(*x.shape[:-1], -1)

    def weight_bytes(self) -> int:
        return tensor_bytes(*(t for pair in self.w_in + self.w_out for t in pair))

    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self._linear(xn, self.w_in[i]).split(self.sizes, dim=-1))

    def output(self, i: int, attn: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """o_proj(attn) + down_proj(act) without the residual add (a fused kernel adds it)."""
        return self._linear(torch.cat([attn, act], dim=-1), self.w_out[i])

    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        return x + self.output(i, attn, act)


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
