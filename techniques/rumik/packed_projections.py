"""Packed projections: Cohere2's parallel block lets one matmul do q,k,v,gate,up.

x + attn(LN(x)) + mlp(LN(x)) feeds LN(x) to all five input projections, so their weights
concatenate into one [q+k+v+gate+up, hidden] matrix (25,088 x 2,048 at real size): one
launch and one pass over the activations instead of five. The model is built with them laid
out that way (model.pack_input_projections), so the packed matrix is the model's own tensor,
not a copy. With `fuse_output`, o_proj and down_proj become one matmul over [attn, act] (a
copy: 1.9 GB at real size). Exact up to summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, Projections, tensor_bytes
from orchestrate.families.rumik.model import input_projections, packed_input_weight


class PackedProjectionsParams(TechniqueParams):
    fuse_output: bool = Field(True, description="Also fuse o_proj and down_proj into one matmul.")


class Packed(Projections):
    def __init__(self, engine: Engine, fuse_output: bool):
        self.w_in: list[torch.Tensor] = []
        self.w_out: list[torch.Tensor] = []
        self.w_o: list[torch.Tensor] = []
        self.w_down: list[torch.Tensor] = []
        self.fuse_output = fuse_output
        for layer in engine.model.lm.model.layers:
            a, m = layer.self_attn, layer.mlp
            shared = packed_input_weight(layer)  # the model's own tensor: no copy
            parts = input_projections(layer)
            self.w_in.append(shared if shared is not None else torch.cat([p.weight for p in parts]))
            if fuse_output:
                self.w_out.append(torch.cat([a.o_proj.weight, m.down_proj.weight], 1).contiguous())
            else:
                self.w_o.append(a.o_proj.weight)
                self.w_down.append(m.down_proj.weight)
        self.sizes = [p.out_features for p in input_projections(engine.model.lm.model.layers[0])]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.w_in, *self.w_out, *self.w_o, *self.w_down]

    def weight_bytes(self) -> int:
        return tensor_bytes(*self.tensors())

    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.linear(xn, self.w_in[i]).split(self.sizes, dim=-1))

    def output(self, i: int, attn: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """o_proj(attn) + down_proj(act) without the residual add (a fused kernel adds it)."""
        if self.fuse_output:
            return self.output_packed(i, torch.cat([attn, act], dim=-1))
        return F.linear(attn, self.w_o[i]) + F.linear(act, self.w_down[i])

    @property
    def output_packed(self) -> Callable[[int, torch.Tensor], torch.Tensor] | None:
        """(i, [attn, act]) -> output, when o_proj and down_proj are one packed weight."""
        if not self.fuse_output:
            return None
        return lambda i, attn_act: F.linear(attn_act, self.w_out[i])

    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        if self.fuse_output:
            return x + F.linear(torch.cat([attn, act], dim=-1), self.w_out[i])
        return x + F.linear(attn, self.w_o[i]) + F.linear(act, self.w_down[i])


class PackedProjections(Technique):
    name = "packed_projections"
    family = "rumik"
    exact = True
    slots = ("projections",)
    after = ("static_kv_cache",)  # only that decoder reads the projections slot
    summary = "One fused q,k,v,gate,up projection (and o+down) per parallel block."
    Params = PackedProjectionsParams

    def apply(self, engine: Engine) -> None:
        engine.projections = Packed(engine, self.params.fuse_output)  # type: ignore[attr-defined]
