"""CFG late-off: from a fraction of the schedule on, steps run the conditioned rows only.

The package's guidance_scale=0 still computes the unconditioned rows (one fused 2B batch),
so it saves nothing; this guidance policy really runs B rows on late steps and uses the
conditioned log-probs there. Approximate: late steps lose guidance.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams


class CFGLateOffParams(TechniqueParams):
    from_fraction: float = Field(
        0.5, gt=0, le=1, description="Steps at index >= ceil(fraction x num_step) drop CFG."
    )


class LateOffGuidance:
    def __init__(self, inner: Any, from_fraction: float):
        self.inner = inner
        self.from_fraction = from_fraction

    def first_off(self, num_step: int) -> int:
        return math.ceil(self.from_fraction * num_step)

    def uncond_rows(self, step: int, cfg: Any) -> bool:
        return step < self.first_off(cfg.num_step) and self.inner.uncond_rows(step, cfg)

    def log_probs(self, c: Any, u: Any, cfg: Any) -> Any:
        return self.inner.log_probs(c, u, cfg)  # u is None on late steps: conditioned only


class CFGLateOff(Technique):
    name = "cfg_late_off"
    family = "omnivoice"
    exact = False
    slots = ("guidance",)
    summary = "late steps run conditioned rows only (half the batch), no guidance there"
    Params = CFGLateOffParams

    def apply(self, engine: Any) -> None:
        engine.guidance = LateOffGuidance(engine.guidance, self.params.from_fraction)
