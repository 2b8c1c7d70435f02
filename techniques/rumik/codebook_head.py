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
from orchestrate.families.rumik.engine import Engine, HeadLogits, tensor_bytes


class CodebookHead(Technique):
    name = "codebook_head"
    family = "rumik"
    exact = False
    slots = ("head",)
    summary = "APPROXIMATE: head restricted to the current codebook (2,049 rows at real size)."

    def apply(self, engine: Engine) -> None:
        model = engine.model
        vocab = model.vocab
        ids = torch.stack(
            [vocab.codebook_ids(q, model.device) for q in range(vocab.num_quantizers)]
        )
        weight = model.lm.lm_head.weight[ids.flatten()].view(*ids.shape, -1).contiguous()
        scale = model.lm.logit_scale
        end = vocab.codebook_size
        units = slice(0, end)

        def head(hidden, step: int | torch.Tensor) -> HeadLogits:
            q = step % vocab.num_quantizers  # the frame position decides the codebook
            if isinstance(q, torch.Tensor):  # a device step counter: choose on the device
                w, cols = weight.index_select(0, q)[0], ids.index_select(0, q)[0]
            else:
                w, cols = weight[q], ids[q]
            return HeadLogits((F.linear(hidden, w) * scale).float(), cols, end, units)

        head.bytes_per_step = tensor_bytes(weight[0])  # type: ignore[attr-defined]
        engine.head = head
