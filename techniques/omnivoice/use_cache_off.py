"""use_cache off: the backbone's forward without building a DynamicCache every step.

Qwen3-0.6B's config ships use_cache=True, so each unmasking forward allocates a cache it
never reads again. This forward is OmniVoice.forward's inference path (embeddings, Qwen3
backbone with the same bool 4D mask, audio heads) with use_cache=False. Exact.
"""

from __future__ import annotations

from typing import Any

from orchestrate.api.technique import Technique, TechniqueParams


def wrapped_too_early(earlier: dict[str, object]) -> str | None:
    """A forward filled after torch_compile wrapped the old one would drop the compile."""
    if "torch_compile" in earlier:
        return "fills 'forward', which torch_compile wraps: list it before torch_compile"
    return None


def no_cache_forward(ov: Any):
    C, V = ov.config.num_audio_codebook, ov.config.audio_vocab_size

    def forward(input_ids, audio_mask, attention_mask):
        embeds = ov._prepare_embed_inputs(input_ids, audio_mask)
        hidden = ov.llm(
            inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False, return_dict=True
        )[0]
        b, s, _ = hidden.shape
        return ov.audio_heads(hidden).view(b, s, C, V).permute(0, 2, 1, 3)

    return forward


class UseCacheOff(Technique):
    name = "use_cache_off"
    family = "omnivoice"
    exact = True
    slots = ("forward",)
    summary = "backbone forward with use_cache=False (no DynamicCache per step)"

    @classmethod
    def check_stack(cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]):
        return wrapped_too_early(earlier)

    def apply(self, engine: Any) -> None:
        engine.forward = no_cache_forward(engine.model.ov)
