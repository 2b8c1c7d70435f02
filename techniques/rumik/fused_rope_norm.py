"""Fused decode-step glue: (residual add +) LayerNorm and interleaved rotary + KV-cache write.

static_kv_cache's decode step spends most of its launches between the projections: the fp32
LayerNorm (upcast, norm, downcast), the interleaved rotary of q and k (slices, stack, negate,
multiply, add, cast), two index_copy cache writes, and the residual add. This technique
keeps static_kv_cache's decoder and replaces, on single-token steps only, that glue with the
Triton kernels of techniques/rumik/kernels/rope_norm.py:

- one `rope_and_cache_write` per layer: rotates q and k of every head at the position read
  from device memory, writes k and v into the layer's cache row (a copy on Cohere2's
  full-attention layers, which carry no positional encoding);
- one `add_layer_norm` per layer: the parallel block's residual add fused with the next
  layer's input norm (the final norm after the last layer), when the projections expose
  `output` (o_proj + down_proj without the add: packed, int8 and int6 do); otherwise the
  projections add the residual and one `layer_norm` kernel follows;
- with `swiglu` (the default), one `swiglu_cat` per layer where the projections take the
  packed [attn, act] row (`output_packed`): silu(gate) * up written beside attn, instead of
  three launches (silu, multiply, concatenate).
- with `into_gemv`, neither of those two launches: the rotary + cache write and the SwiGLU
  are the input GEMV's epilogue (its gate and up rows interleaved in pairs) and the output GEMV
  reads [attn, act] from the two rows (kernels/fused_gemv.py), for projections that offer such
  GEMVs (`qkv_rope_act`, `output_cat`: int8_projections). Five
  launches a layer instead of seven; the same roundings (a GEMV row's fp32 sum may be reduced
  in another order).

The subclass goes in the engine's `decoder_class` slot, which static_kv_cache's factory
builds; the PDL flag of its launches is the engine's `launch` option, read at each step.
Prefill (more than one token) keeps the unfused path. The position is only read on the
device, so the step stays capturable by cuda_graph / graph_loop. Exact up to rounding order:
the same fp32 maths, checked on teacher-forced logits against stock.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams, UnsupportedConfig
from orchestrate.families.rumik.engine import Engine
from orchestrate.techniques.rumik.static_kv_cache import StaticDecoder, StaticKVCacheParams

# The kernels' limits (techniques/rumik/kernels/rope_norm.py), checked before any launch.
MAX_NORM_WIDTH = 16384
MAX_HEADS = 64
MAX_HEAD_DIM = 256


def check_supported(hidden: int, hq: int, hkv: int, head_dim: int) -> None:
    if head_dim % 2 or head_dim & (head_dim - 1) or head_dim > MAX_HEAD_DIM:
        raise UnsupportedConfig(
            f"fused_rope_norm: head_dim must be an even power of two <= {MAX_HEAD_DIM}; "
            f"this model has {head_dim}"
        )
    if hq > MAX_HEADS or hkv > MAX_HEADS:
        raise UnsupportedConfig(
            f"fused_rope_norm: at most {MAX_HEADS} query/KV heads; this model has {hq}/{hkv}"
        )
    if hidden > MAX_NORM_WIDTH:
        raise UnsupportedConfig(
            f"fused_rope_norm: hidden size must be <= {MAX_NORM_WIDTH}; this model has {hidden}"
        )


class FusedRopeNormParams(TechniqueParams):
    swiglu: bool = Field(
        True,
        description="silu(gate) * up and the packed [attn, act] row in one kernel "
        "(where the projections take that row).",
    )
    into_gemv: bool = Field(
        False,
        description="rotary, cache write and SwiGLU in the input GEMV's epilogue, the output "
        "GEMV reading [attn, act] from two rows: two launches a layer fewer (int8 only).",
    )
    preload: bool = Field(
        True,
        description="with into_gemv: each GEMV program loads its first weight chunk before "
        "its PDL wait.",
    )


@dataclass(frozen=True)
class RopeArgs:
    """What the input GEMV's rotary epilogue needs besides its weights (into_gemv)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    position: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rotary: bool


class FusedRopeNormDecoder(StaticDecoder):
    """static_kv_cache's decoder with the decode step's glue in three kernels per layer
    (two with `swiglu`: the activation joins the packed row's kernel)."""

    def __init__(
        self,
        engine: Engine,
        max_seq_len: int,
        compile_mode: str | None,
        *,
        swiglu: bool = True,
        into_gemv: bool = False,
        preload: bool = True,
    ):
        if compile_mode:
            raise UnsupportedConfig(
                "fused_rope_norm: static_kv_cache.compile must be false (Triton launches are "
                "not traced by torch.compile here)"
            )
        super().__init__(engine, max_seq_len, None)
        check_supported(self.embed.shape[1], self.hq, self.hkv, self.d)
        # The kernel's tables hold one value per rotary pair: the interleaved tables' even
        # columns (already rounded to the model dtype, as transformers rounds them).
        self.cos_half = self.cos[:, ::2].contiguous()
        self.sin_half = self.sin[:, ::2].contiguous()
        self.next_norm = [*self.norms[1:], self.final_norm]
        self.output = getattr(self.proj, "output", None)
        self.output_packed = getattr(self.proj, "output_packed", None) if swiglu else None
        self.into_gemv, self.preload = into_gemv, preload
        if into_gemv:
            if not all(hasattr(self.proj, m) for m in ("qkv_rope_act", "output_cat")):
                raise UnsupportedConfig(
                    f"fused_rope_norm: into_gemv needs projections with fused GEMVs "
                    f"(int8_projections); this stack's are {type(self.proj).__name__}"
                )
            self.proj.interleave_gate_up()  # the order the fused input GEMV reads
        self.engine = engine  # its `launch` option is read at each decode step

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] != 1:
            raise UnsupportedConfig(f"fused_rope_norm: batch must be 1, got {ids.shape[0]}")
        if ids.shape[1] != 1:  # prefill: the unfused path over the whole prompt
            return super()._forward(ids, positions)
        from orchestrate.techniques.rumik.kernels import rope_norm as rn
        from orchestrate.techniques.rumik.kernels.swiglu import swiglu_cat

        pdl, eps = self.engine.launch.pdl, self.eps
        x = F.embedding(ids, self.embed)
        xn = rn.layer_norm(x, self.norms[0], eps, launch_pdl=pdl)
        for i in range(len(self.norms)):
            if self.into_gemv:
                xn, x = self._layer_into_gemv(i, xn, x, positions)
                continue
            q, k, v, gate, up = self.proj.qkvgu(i, xn)
            q = rn.rope_and_cache_write(
                q, k, v, self.k[i], self.v[i], positions, self.cos_half, self.sin_half,
                rotary=self.sliding[i], launch_pdl=pdl,
            )  # fmt: skip
            window = self.window if self.sliding[i] else None
            attn = self.attend(q.view(1, self.hq, 1, self.d), self.k[i], self.v[i], positions,
                               window)  # fmt: skip
            attn = attn.transpose(1, 2).reshape(1, 1, self.hq * self.d)
            if self.output_packed is not None:
                delta = self.output_packed(i, swiglu_cat(attn, gate, up, launch_pdl=pdl))
                xn, x = rn.add_layer_norm(delta, x, self.next_norm[i], eps, launch_pdl=pdl)
            elif self.output is not None:
                delta = self.output(i, attn, F.silu(gate) * up)
                xn, x = rn.add_layer_norm(delta, x, self.next_norm[i], eps, launch_pdl=pdl)
            else:
                x = self.proj.residual(i, x, attn, F.silu(gate) * up)
                xn = rn.layer_norm(x, self.next_norm[i], eps, launch_pdl=pdl)
        return xn  # the last iteration applied the final norm

    def _layer_into_gemv(
        self, i: int, xn: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer in five launches: GEMV + rotary + cache write + SwiGLU, attention (split
        and merge), GEMV of [attn, act], add + next norm."""
        from orchestrate.techniques.rumik.kernels import rope_norm as rn

        rope = RopeArgs(self.k[i], self.v[i], positions, self.cos_half, self.sin_half,
                        self.sliding[i])  # fmt: skip
        q, act = self.proj.qkv_rope_act(i, xn, rope, preload=self.preload)
        window = self.window if self.sliding[i] else None
        attn = self.attend(q.view(1, self.hq, 1, self.d), self.k[i], self.v[i], positions, window)
        attn = attn.transpose(1, 2).reshape(1, 1, self.hq * self.d)
        delta = self.proj.output_cat(i, attn, act, preload=self.preload)
        return rn.add_layer_norm(delta, x, self.next_norm[i], self.eps,
                                 launch_pdl=self.engine.launch.pdl)  # fmt: skip


class FusedRopeNorm(Technique):
    name = "fused_rope_norm"
    family = "rumik"
    # 2: the SwiGLU + pack kernel (swiglu, default on); the records of ff0fdf1 say @1.
    # 3: into_gemv and preload (default off: version 2's launches).
    version = 3
    exact = True
    slots = ("decoder_class",)  # static_kv_cache's factory builds this subclass
    wraps = ("decoder",)  # to check that it did
    requires = ("cuda", "package:triton")
    after = ("static_kv_cache",)
    summary = (
        "Triton (residual add +) LayerNorm, rotary + KV-cache write and SwiGLU + packing on "
        "decode steps."
    )
    Params = FusedRopeNormParams

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        static = earlier.get("static_kv_cache")
        if isinstance(static, StaticKVCacheParams) and static.compile:
            return "needs static_kv_cache without compile (its Triton launches are not traced)"
        return None

    def apply(self, engine: Engine) -> None:
        check_supported(
            engine.model.config.hidden_size,
            engine.model.config.num_attention_heads,
            engine.model.config.num_key_value_heads,
            engine.model.config.head_dim,
        )
        p: FusedRopeNormParams = self.params  # type: ignore[assignment]
        engine.decoder_class = functools.partial(
            FusedRopeNormDecoder, swiglu=p.swiglu, into_gemv=p.into_gemv, preload=p.preload
        )
        inner = engine.decoder_factory

        def factory(eng: Engine, need: int):
            decoder = inner(eng, need)
            base = getattr(decoder, "inner", decoder)  # under cuda_graph
            if not isinstance(base, FusedRopeNormDecoder):  # never a silent no-op
                raise TypeError(
                    "fused_rope_norm needs static_kv_cache's decoder; the decoder in use is "
                    f"{type(base).__name__}"
                )
            return decoder

        engine.decoder_factory = factory
