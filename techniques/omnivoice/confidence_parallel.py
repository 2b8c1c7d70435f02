"""Confidence-parallel unmasking (Fast-dLLM style) under a step limit.

Each step commits every masked position whose guided top probability reaches `threshold`
(at least the single best-scored one), the last step fills whatever is left, and the loop
exits as soon as nothing is masked. The schedule's per-step counts are not used.
Approximate: which positions commit together changes (the write-up saw quality collapse).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams


class ConfidenceParallelParams(TechniqueParams):
    threshold: float = Field(0.9, gt=0, le=1, description="Commit when top prob >= this.")
    step_limit: int = Field(16, ge=1, description="At most this many steps (sets num_step).")


class ConfidenceUnmask:
    def __init__(self, threshold: float):
        self.threshold = threshold

    def __call__(self, log_probs, tokens, k, step, cfg, mask_id) -> None:
        from orchestrate.families.omnivoice.engine import position_scores, predict

        pred, conf = predict(log_probs, cfg, mask_id)
        masked = tokens == mask_id
        if step == cfg.num_step - 1:
            commit = masked  # the last step fills everything left
        else:
            commit = masked & (conf.exp() >= self.threshold)
            if not bool(commit.any()) and bool(masked.any()):
                best = position_scores(conf, tokens, cfg, mask_id).flatten().argmax()
                commit = torch.zeros_like(masked).flatten()
                commit[best] = True
                commit = commit.view_as(masked)
        tokens.copy_(torch.where(commit, pred, tokens))

    def done(self, tokens: torch.Tensor, batch: Any, mask_id: int) -> bool:
        return not bool((tokens == mask_id).any())


class ConfidenceParallel(Technique):
    name = "confidence_parallel"
    family = "omnivoice"
    exact = False
    slots = ("unmask", "knob.num_step")  # the step limit is the step count
    summary = "commit all positions above a confidence threshold; early exit when done"
    Params = ConfidenceParallelParams

    def apply(self, engine: Any) -> None:
        engine.unmask = ConfidenceUnmask(self.params.threshold)
        engine.knobs["num_step"] = self.params.step_limit
