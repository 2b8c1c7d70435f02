"""Audio-only output head: project onto the 16,385 ids speech can sample, not 277,404.

Inside an audio span only the 16,384 unit tokens and end-of-audio are legal, and stock
masks every other column to -inf anyway. Gathering those rows of the tied head once
removes 94% of the head's bytes and the 277k-wide mask, top-k and softmax. Exact: every
legal token gets the same logit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orchestrate.api.technique import Technique
from orchestrate.families.rumik.engine import Engine, Head, HeadLogits, tensor_bytes
from orchestrate.families.rumik.model import RumikModel


class AudioRowsHead(Head):
    """The tied head's rows of the audio units and end-of-audio, gathered once."""

    def __init__(self, model: RumikModel):
        self.ids = model.vocab.candidate_ids(model.device)
        self.weight = model.lm.lm_head.weight[self.ids].contiguous()
        self.scale = model.lm.logit_scale
        self.end = self.ids.numel() - 1
        self.units = slice(0, self.end)
        self.bytes_per_step = tensor_bytes(self.weight)

    def __call__(self, hidden: torch.Tensor, step: int | torch.Tensor) -> HeadLogits:
        logits = F.linear(hidden, self.weight) * self.scale
        return HeadLogits(logits.float(), self.ids, self.end, self.units)


class AudioHead(Technique):
    name = "audio_head"
    family = "rumik"
    exact = True
    slots = ("head",)
    summary = "Output head restricted to audio units + end-of-audio (16,385 rows at real size)."

    def apply(self, engine: Engine) -> None:
        engine.head = AudioRowsHead(engine.model)
