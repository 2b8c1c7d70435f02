"""Decode attention that reads only filled cache positions (Triton, flash-decoding).

The fixed-shape decoder attends over the whole preallocated cache with a mask, reading
every position every step. This kernel reads the current length from device memory and
touches only positions < length (and, on sliding layers, only the last `window`), so its
cost follows the real sequence and it stays valid inside a captured graph. Exact up to
summation order; prefill (more than one query) keeps the masked SDPA.
"""

from __future__ import annotations

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams, UnsupportedConfig
from orchestrate.families.rumik.engine import Engine, masked_sdpa


class DecodeAttentionParams(TechniqueParams):
    num_splits: int = Field(16, ge=1, le=128, description="Split-K programs per KV head.")
    block_s: int = Field(64, ge=16, le=256)
    pdl: bool = Field(False, description="Programmatic dependent launch (Hopper).")


class DecodeAttention(Technique):
    name = "decode_attention"
    family = "rumik"
    exact = True
    slots = ("attention",)
    requires = ("cuda", "package:triton")
    after = ("static_kv_cache",)
    summary = "Triton split-K decode attention over filled cache positions only."
    Params = DecodeAttentionParams

    def apply(self, engine: Engine) -> None:
        from orchestrate.techniques.rumik.kernels.decode_attention import decode_attention

        p: DecodeAttentionParams = self.params  # type: ignore[assignment]
        head_dim = engine.model.config.head_dim
        if head_dim != 128:
            raise UnsupportedConfig(
                f"decode_attention supports head_dim 128; this model has {head_dim}"
            )

        def attend(q, k_cache, v_cache, positions, window):
            if q.shape[2] != 1:  # prefill
                return masked_sdpa(q, k_cache, v_cache, positions, window)
            out = decode_attention(
                q[:, :, 0],
                k_cache,
                v_cache,
                positions,
                length_offset=1,  # the length is position + 1, added on the device
                window=window or 0,
                num_splits=p.num_splits,
                block_s=p.block_s,
                launch_pdl=p.pdl or engine.launch.pdl,  # own param, or the engine's option
            )
            return out.unsqueeze(2)

        engine.attention = attend
