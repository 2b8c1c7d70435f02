"""OmniVoice's per-slot time (`OmniVoiceFamily.slot_profile`): milliseconds per unmasking
step (per forward pass) that each slot's part spends itself, over one synthesis of the
text at the workload's own length (a length the engine has not run would be a new shape:
a compiled forward would recompile, a captured loop capture anew), the engine restored
after.

The package's own loop (stock) calls none of the loop-internal slots, so for the profile
it is stood in for by `slot_loop`, which tests prove returns the same codes: a stock
profile then splits forward, schedule, guidance and unmask instead of reporting one
`loop`. The codec runs once per synthesis; its time is spread over the steps like the
rest, so the slots add up to the synthesis. A captured loop (cuda_graph_loop) replays its
forwards without calling back into Python: their time is reported as `loop`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from orchestrate.api.config import Workload
from orchestrate.api.family import Synthesis
from orchestrate.api.slot_clock import Patches, SlotClock, Timed
from orchestrate.families.omnivoice.engine import Engine, package_loop, slot_loop

WARMUPS = 2  # untimed first: reduce-overhead graphs record on their second call
CALLABLE_SLOTS = ("forward", "schedule", "unmask", "loop", "codec")
GUIDANCE_METHODS = ("uncond_rows", "log_probs")


def slot_profile(
    engine: Engine,
    text: str,
    seed: int,
    workload: Workload,
    synthesize: Callable[[Engine, str, int, Workload], Synthesis],
) -> dict[str, float]:
    clock = SlotClock(torch.device(engine.model.device))
    patches = Patches()
    try:
        if engine.loop is package_loop:
            patches.set(engine, "loop", slot_loop)
        for slot in CALLABLE_SLOTS:
            patches.set(engine, slot, Timed(clock, slot, getattr(engine, slot)))
        patches.time_methods(clock, "guidance", engine.guidance, GUIDANCE_METHODS)
        for _ in range(WARMUPS):
            synthesize(engine, text, seed, workload)
        clock.active = True
        syn = synthesize(engine, text, seed, workload)
        steps = syn.forward_passes or 0
    finally:
        patches.restore()
    return clock.ms_per_step(steps)
