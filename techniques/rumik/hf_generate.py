"""Baseline B: what a user would pick instead of the stock loop.

transformers' generate() with a static cache (and, on a GPU, its automatic torch.compile
of the decode step), restricted to the audio vocabulary by a logits processor. It does
not evaluate the stop head, and samples with transformers' own sampler and the global RNG,
so its tokens differ from stock's: marked approximate, and used as a baseline, not a
candidate.
"""

from __future__ import annotations

from orchestrate.api.technique import Technique
from orchestrate.families.rumik.engine import Engine


class HFGenerateStatic(Technique):
    name = "hf_generate_static"
    family = "rumik"
    exact = False
    slots = ("loop",)
    stands_alone = True  # generate() runs the model's own modules, not the engine's slots
    summary = "Baseline B: transformers generate() with a static cache (auto-compiled on GPU)."

    def apply(self, engine: Engine) -> None:
        from orchestrate.techniques.rumik.hf_loop import hf_generate_loop

        engine.loop = hf_generate_loop
