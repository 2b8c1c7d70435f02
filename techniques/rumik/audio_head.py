"""Audio-only output head: project onto the 16,385 ids speech can sample, not 277,404.

Inside an audio span only the 16,384 unit tokens and end-of-audio are legal, and stock
masks every other column to -inf anyway. Gathering those rows of the tied head once
removes 94% of the head's bytes and the 277k-wide mask, top-k and softmax. Exact: every
legal token gets the same logit.
"""

from __future__ import annotations

import torch.nn.functional as F

from orchestrate.api.technique import Technique
from orchestrate.families.rumik.engine import Engine, HeadLogits, tensor_bytes


class AudioHead(Technique):
    name = "audio_head"
    family = "rumik"
    exact = True
    slots = ("head",)
    summary = "Output head restricted to audio units + end-of-audio (16,385 rows at real size)."

    def apply(self, engine: Engine) -> None:
        model = engine.model
        ids = model.vocab.candidate_ids(model.device)
        weight = model.lm.lm_head.weight[ids].contiguous()
        scale = model.lm.logit_scale
        end = ids.numel() - 1
        units = slice(0, end)

        def head(hidden, step: int) -> HeadLogits:
            return HeadLogits((F.linear(hidden, weight) * scale).float(), ids, end, units)

        head.bytes_per_step = tensor_bytes(weight)  # type: ignore[attr-defined]
        engine.head = head
