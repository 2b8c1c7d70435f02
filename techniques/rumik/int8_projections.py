"""INT8 weight-only decode projections (APPROXIMATE), packed as in packed_projections.

Batch-1 decode is bound by reading weights; int8 halves those bytes. Weights are quantised
once per output channel (symmetric, scale = absmax / 127) and a Triton GEMV dequantises in
registers (torch._weight_int8pack_mm is ~25x slower than cuBLAS bf16 at M=1 on an H200).
Prefill (more than 4 rows) multiplies by the dequantised weights, so it sees the same
rounded weights. Rounding changes the logits: fidelity and quality gates decide.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, Projections, tensor_bytes
from orchestrate.families.rumik.model import input_projections

MAX_GEMV_ROWS = 4


class Int8Params(TechniqueParams):
    pdl: bool = Field(False, description="Programmatic dependent launch (Hopper).")
    preload: bool = Field(
        False,
        description="Each decode GEMV program loads its first weight chunk before its PDL "
        "wait (a launch option; numerically the same GEMV).",
    )
    gemv_configs: Literal["shipped", "pdl_tuned"] = Field(
        "shipped",
        description="Which measured table of GEMV launch configs the decode GEMVs use "
        "(kernels/int8_gemv.GEMV_TABLES): `shipped` (H200_CONFIGS alone) or `pdl_tuned` (the "
        "winners of the INT8 GEMV sweep with PDL); a table's reduce_each changes the "
        "summation order.",
    )


class QuantizedPacked(Projections):
    """Packed q,k,v,gate,up (and o+down) weights, quantised per output channel. Decode
    rows go through a subclass's GEMV kernel; prefill multiplies by the dequantised
    weights, so both see the same rounded weights."""

    max_gemv_rows: int = MAX_GEMV_ROWS

    def __init__(self, engine: Engine, pdl: bool):
        self.check(engine.model.config)
        self.engine = engine  # its `launch` option is read at each kernel call
        self.pdl = pdl  # this technique's own `pdl` param; engine.launch.pdl adds the rest
        self.w_in: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.w_out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in engine.model.lm.model.layers:
            a, m = layer.self_attn, layer.mlp
            w_in = torch.cat([p.weight for p in input_projections(layer)])
            self.w_in.append(self.quantize(w_in))
            self.w_out.append(self.quantize(torch.cat([a.o_proj.weight, m.down_proj.weight], 1)))
            del w_in
        self.sizes = [p.out_features for p in input_projections(engine.model.lm.model.layers[0])]
        self.plain_rows: torch.Tensor | None = None  # set by interleave_gate_up (Int8Packed)

    def check(self, cfg: Any) -> None:  # an optional hook: int8 fits any shape
        """Raise when the model's shapes do not fit the packing."""

    @property
    def launch_pdl(self) -> bool:
        """PDL for this call: asked for by this technique's params or by the engine."""
        return self.pdl or self.engine.launch.pdl

    @abc.abstractmethod
    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def gemv(self, rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def dequantize(
        self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor: ...

    def _linear(self, x: torch.Tensor, qs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.max_gemv_rows:
            y = self.gemv(rows, *qs)
        else:
            y = F.linear(rows, self.dequantize(*qs, x.dtype))
        return y.view(*x.shape[:-1], -1)

    def weight_bytes(self) -> int:
        return tensor_bytes(*(t for pair in self.w_in + self.w_out for t in pair))

    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.plain_rows is None:  # gate and up rows in their plain order
            return tuple(self._linear(xn, self.w_in[i]).split(self.sizes, dim=-1))
        rows = xn.reshape(-1, xn.shape[-1])
        if rows.shape[0] > self.max_gemv_rows:  # prefill: the dequantised rows, plain order,
            # so its GEMM (and its rounding) is the one without interleave_gate_up
            w = self.dequantize(*self.w_in[i], xn.dtype)[self.plain_rows]
            y = F.linear(rows, w).view(*xn.shape[:-1], -1)
            return tuple(y.split(self.sizes, dim=-1))
        y = self._linear(xn, self.w_in[i])
        q, k, v, gu = y.split([*self.sizes[:3], sum(self.sizes[3:])], dim=-1)
        return q, k, v, gu[..., 0::2], gu[..., 1::2]  # (gate_j, up_j) pairs

    def output(self, i: int, attn: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """o_proj(attn) + down_proj(act) without the residual add (a fused kernel adds it)."""
        return self.output_packed(i, torch.cat([attn, act], dim=-1))

    def output_packed(self, i: int, attn_act: torch.Tensor) -> torch.Tensor:
        """output() from the concatenated [attn, act] row."""
        return self._linear(attn_act, self.w_out[i])

    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        return x + self.output(i, attn, act)


class Int8Packed(QuantizedPacked):
    def __init__(
        self, engine: Engine, pdl: bool, preload: bool = False, gemv_configs: str = "shipped"
    ):
        from orchestrate.techniques.rumik.kernels.int8_gemv import GEMV_TABLES

        super().__init__(engine, pdl)
        self.preload = preload  # see Int8Params
        self.gemv_table = GEMV_TABLES[gemv_configs]  # shapes absent: int8_linear's default

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from orchestrate.techniques.rumik.kernels.int8_gemv import quantize_int8

        return quantize_int8(w)

    def gemv(self, rows: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        from orchestrate.techniques.rumik.kernels.int8_gemv import int8_linear

        config = self.gemv_table.get((q.shape[0], q.shape[1]))
        return int8_linear(rows, q, scale, config=config, launch_pdl=self.launch_pdl,
                           preload=self.preload)  # fmt: skip

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        from orchestrate.techniques.rumik.kernels.int8_gemv import dequantize_int8

        return dequantize_int8(q, scale).to(dtype)

    # The GEMVs with the decode step's glue folded in (kernels/fused_gemv.py), for one decode
    # row; fused_rope_norm's `into_gemv` calls them, after interleave_gate_up().

    def interleave_gate_up(self) -> None:
        """Reorder each input weight's gate and up rows as (gate_j, up_j) pairs, the order the
        fused input GEMV reads; qkvgu() then reads them back in that order. Idempotent."""
        from orchestrate.techniques.rumik.kernels.fused_gemv import interleave_gate_up

        if self.plain_rows is not None:
            return
        start = sum(self.sizes[:3])
        self.w_in = [(interleave_gate_up(q, start), interleave_gate_up(s, start))
                     for q, s in self.w_in]  # fmt: skip
        order = interleave_gate_up(torch.arange(sum(self.sizes)), start)
        self.plain_rows = torch.argsort(order).to(self.w_in[0][0].device)  # its inverse

    def qkv_rope_act(
        self, i: int, xn: torch.Tensor, rope: Any, *, preload: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated q, silu(gate) * up) of layer i; k and v go straight into the layer's cache
        row. `rope`: the caches, position and tables (fused_rope_norm.RopeArgs)."""
        from orchestrate.techniques.rumik.kernels.fused_gemv import int8_linear_rope_act

        if self.plain_rows is None:
            raise RuntimeError("qkv_rope_act reads (gate_j, up_j) pairs: interleave_gate_up first")
        return int8_linear_rope_act(
            xn.reshape(-1), *self.w_in[i], rope.position, rope.cos, rope.sin, rope.k_cache,
            rope.v_cache, q_size=self.sizes[0], kv_size=self.sizes[1], rotary=rope.rotary,
            preload=preload, launch_pdl=self.launch_pdl,
        )  # fmt: skip

    def output_cat(
        self, i: int, attn: torch.Tensor, act: torch.Tensor, *, preload: bool = True
    ) -> torch.Tensor:
        """output_packed(i, cat([attn, act])) without storing that row."""
        from orchestrate.techniques.rumik.kernels.fused_gemv import int8_linear_cat

        y = int8_linear_cat(attn.reshape(-1), act, *self.w_out[i], preload=preload,
                            launch_pdl=self.launch_pdl)  # fmt: skip
        return y.view(*attn.shape[:-1], -1)


class Int8Projections(Technique):
    name = "int8_projections"
    family = "rumik"
    exact = False
    slots = ("projections",)
    requires = ("cuda", "package:triton")
    after = ("static_kv_cache",)
    summary = "APPROXIMATE: int8 weight-only packed projections with a Triton GEMV."
    # 2: the `preload` param; 3: `gemv_configs` (off and "shipped": version 1's launches)
    version = 3
    Params = Int8Params

    def apply(self, engine: Engine) -> None:
        p: Int8Params = self.params  # type: ignore[assignment]
        engine.projections = Int8Packed(engine, p.pdl, p.preload, p.gemv_configs)
