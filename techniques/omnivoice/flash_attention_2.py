"""Flash Attention 2: refused, with the reason, as the write-up recorded it.

OmniVoice 0.2.1 sets `_supports_flash_attn_2`, but transformers 5 checks
`_supports_flash_attn`, so loading with attn_implementation="flash_attention_2" fails with
"does not support Flash Attention 2 yet"; forcing the backbone's implementation then meets
OmniVoice's bool 4D masks, which the varlen FA2 path does not take. The refusal is checked
live, so a package version that does support it is told apart (and still not faked here).
"""

from __future__ import annotations

from typing import Any

from orchestrate.api.technique import Refused, Technique


class FlashAttention2(Technique):
    name = "flash_attention_2"
    family = "omnivoice"
    exact = True
    slots = ("forward",)
    summary = "refused: OmniVoice does not support Flash Attention 2 yet (ledger entry)"

    def apply(self, engine: Any) -> None:
        cls = type(engine.model.ov)
        if not getattr(cls, "_supports_flash_attn", False):
            raise Refused(
                f"{cls.__name__} does not support Flash Attention 2 yet: the class sets "
                "_supports_flash_attn_2 but transformers 5 checks _supports_flash_attn; "
                "forcing it on the backbone fails on OmniVoice's bool 4D attention masks"
            )
        raise Refused(
            f"{cls.__name__} now declares Flash Attention support; this technique has no "
            "implementation for it yet (it would need a varlen path for the CFG masks)"
        )
