"""Current-codebook head: only codebook (step % 8)'s 2,048 units + end-of-audio.

APPROXIMATE. Stock lets any audio unit follow any other; this head enforces the expected
q0..q7 order, so it changes the sampling distribution wherever stock would have put mass
on another codebook. It goes through fidelity reporting and quality gates, never the
exactness check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from orchestrate.api.technique import Technique
from orchestrate.families.rumik.engine import Engine, Head, HeadLogits, tensor_bytes
from orchestrate.families.rumik.model import RumikModel


class CurrentCodebookHead(Head):
    """Per step, the rows of codebook (step % 8)'s units + end-of-audio, gathered once."""

    def __init__(self, model: RumikModel):
        vocab = model.vocab
        self.num_quantizers = vocab.num_quantizers
        self.ids = torch.stack(
            [vocab.codebook_ids(q, model.device) for q in range(vocab.num_quantizers)]
        )
        self.weight = (
            model.lm.lm_head.weight[self.ids.flatten()].view(*self.ids.shape, -1).contiguous()
        )
        self.scale = model.lm.logit_scale
        self.end = vocab.codebook_size
        self.units = slice(0, self.end)
        self.bytes_per_step = tensor_bytes(self.weight[0])  # one codebook's rows per step

    def __call__(self, hidden: torch.Tensor, step: int | torch.Tensor) -> HeadLogits:
        q = step % self.num_quantizers  # the frame position decides the codebook
        if isinstance(q, torch.Tensor):  # a device step counter: choose on the device
            w, cols = self.weight.index_select(0, q)[0], self.ids.index_select(0, q)[0]
        else:
            w, cols = self.weight[q], self.ids[q]
        return HeadLogits((F.linear(hidden, w) * self.scale).float(), cols, self.end, self.units)


class CodebookHead(Technique):
    name = "codebook_head"
    family = "rumik"
    exact = False
    slots = ("head",)
    summary = "APPROXIMATE: head restricted to the current codebook (2,049 rows at real size)."

    def apply(self, engine: Engine) -> None:
        engine.head = CurrentCodebookHead(engine.model)
