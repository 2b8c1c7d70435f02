"""Rumik's per-slot time (`RumikFamily.slot_profile`): milliseconds per decode step that
each slot's part spends itself, over one short synthesis, the engine restored after.

Timers go on the parts in place, not on a copy of the engine: static_kv_cache builds one
decoder per engine that keeps its own references to the projections and the attention
(`self.proj`, `self.attend`), so only the same objects, timed and put back, reach them.
`decoder` includes the prefill (amortised over the steps) and, when its step is compiled,
the projections and attention (never timed then: see `_wire`); `loop` is the token loop's
own time (stop head, host syncs, and everything a captured loop replays). `decoder_class`
and `launch` are configuration, not calls: never reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from orchestrate.api.config import LengthPolicy, Workload
from orchestrate.api.family import Synthesis
from orchestrate.api.slot_clock import Patches, SlotClock, Timed
from orchestrate.families.rumik.engine import Engine

FRAMES = 16  # one short utterance: 128 decode steps (no decode shape depends on it)
WARMUPS = 2
CALLABLE_SLOTS = ("attention", "head", "sampler", "loop")  # engine fields called directly
PROJECTION_METHODS = ("qkvgu", "residual", "output")
DECODER_METHODS = ("prefill", "step")


def slot_profile(
    engine: Engine,
    text: str,
    seed: int,
    workload: Workload,
    synthesize: Callable[[Engine, str, int, Workload], Synthesis],
    frames: int | None = None,
) -> dict[str, float]:
    clock = SlotClock(torch.device(engine.model.device))
    patches = Patches()
    policy = LengthPolicy(mode="fixed", frames=frames or FRAMES)
    short = workload.model_copy(update={"length_policy": policy, "measure_ttfa": False})
    try:
        _wire(engine, clock, patches)
        # Untimed first: a graph captured anew for the profile's length, or recorded on
        # its second call (reduce-overhead), pays that here, not in the profile.
        for _ in range(WARMUPS):
            synthesize(engine, text, seed, short)
        clock.active = True
        syn = synthesize(engine, text, seed, short)
    finally:
        patches.restore()
    return clock.ms_per_step(syn.new_tokens)


def _wire(engine: Engine, clock: SlotClock, patches: Patches) -> None:
    parts = {slot: getattr(engine, slot) for slot in CALLABLE_SLOTS}
    timed = {slot: Timed(clock, slot, part) for slot, part in parts.items()}
    for slot in ("head", "sampler", "loop"):
        patches.set(engine, slot, timed[slot])
    factory = engine.decoder_factory

    def timed_factory(eng: Engine, max_seq_len: int) -> Any:
        decoder = factory(eng, max_seq_len)
        patches.time_methods(clock, "decoder", decoder, DECODER_METHODS)
        if _compiled(decoder):
            # A timer on a part the compiled step calls changes what it guards on: it would
            # recompile, and on the H200 the restored engine then ran 1.6x slower. Their
            # time stays in `decoder`, where a compiled step spends it anyway.
            return decoder
        patches.time_methods(clock, "projections", engine.projections, PROJECTION_METHODS)
        if engine.attention is parts["attention"]:
            patches.set(engine, "attention", timed["attention"])
        # A decoder that kept a slot's part (static_kv_cache's `attend`) calls it directly.
        for name, value in list(getattr(decoder, "__dict__", {}).items()):
            if value is parts["attention"]:
                patches.set(decoder, name, timed["attention"])
        return decoder

    patches.set(engine, "decoder_factory", timed_factory)


def _compiled(decoder: Any) -> bool:
    """Whether the decoder (or a decoder it wraps) holds a torch.compile'd callable."""
    inner = [v for v in vars(decoder).values() if hasattr(v, "__dict__")]
    for obj in (decoder, *inner):
        values = getattr(obj, "__dict__", {}).values()
        if any(hasattr(v, "_torchdynamo_orig_callable") for v in values):
            return True
    return False
