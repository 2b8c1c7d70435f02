"""What a model family plugin is: its engine's slots, its presets and defaults, and the
five calls the worker makes (build the model, build an engine for a stack, time one
synthesis, count the bytes a step must move, measure fidelity against stock).

A family is a package with one entry point in the group `orchestrate.families`:

    [project.entry-points."orchestrate.families"]
    my_tts = "my_pkg.family:MyTTSFamily"

The core never imports a family: the worker finds it by the name in ModelSpec.family
(`orchestrate.api.registry.get_family`). Techniques name the family they modify and may
fill or wrap only the slots it declares here; a technique claiming another slot is refused
at discovery, by name, and one whose `apply` changes a slot it did not claim is refused when
the engine is built (`Family.apply_checked`).
"""

from __future__ import annotations

import abc
import fnmatch
import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from orchestrate.api.config import ModelSpec, Workload
from orchestrate.api.records import FidelityRecord
from orchestrate.api.technique import BuiltStack, Refused, Technique


def configs_hash(**configs: Any) -> str:
    """16 hex digits naming a model's architecture: its configs' dicts, keys sorted (the
    environment records it, so results of different shapes are never compared)."""
    blob = json.dumps({k: c.to_dict() for k, c in configs.items()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def seed_codebooks(codec: Any) -> int:
    """Give a random-weight codec's vector-quantizer codebooks random entries, from the
    global (seeded) generator; returns how many it filled.

    transformers builds EMA codebooks (Mimi's, the Higgs audio tokenizer's, Encodec's) as
    zero buffers that only training fills, so under random weights every code decodes to
    the same vector: the waveform does not depend on the generated codes, and the worker's
    "audio independent of input" guard fired for every stack, stock included, which left it
    blind to a stack that really ignores its input. Raises where no such codebook is found
    (a renamed buffer would silently bring that back)."""
    import torch

    filled = 0
    for module in codec.modules():
        if not type(module).__name__.endswith("EuclideanCodebook"):
            continue
        entries = getattr(module, "embed_sum", None)  # Mimi: embed = embed_sum / usage
        if entries is None:
            entries = module.embed  # Higgs, Encodec: the table itself
        entries.normal_()
        for stat in ("cluster_usage", "cluster_size"):  # counts, so that embed = entries
            if isinstance(getattr(module, stat, None), torch.Tensor):
                getattr(module, stat).fill_(1.0)
        if isinstance(getattr(module, "embed_avg", None), torch.Tensor):
            module.embed_avg.copy_(entries)
        if hasattr(module, "_embed"):
            module._embed = None  # Mimi caches embed on first use
        filled += 1
    if not filled:
        raise RuntimeError(
            f"{type(codec).__name__}: no EuclideanCodebook to seed; with random weights its "
            "audio would not depend on the codes"
        )
    return filled


class UndeclaredSlot(Refused):
    """A technique's `apply` changed a slot it does not declare: the stack is refused (a
    measurement of it would be credited to the declared slots only)."""

    def __init__(self, technique: str, slots: list[str], declared: tuple[str, ...]):
        self.technique, self.slots = technique, slots
        named = ", ".join(repr(s) for s in slots)
        plural = "slots" if len(slots) > 1 else "slot"
        super().__init__(
            f"technique {technique!r} changed the {named} {plural}, which it does not declare "
            f"(it declares {', '.join(declared) or 'none'}); a technique may replace only "
            "the slots it declares"
        )


def _same(before: object, after: object) -> bool:
    """Whether a slot's occupant is unchanged: the same object, or an equal value of the same
    type (a knob set to the value it had; a bound method, which getattr makes anew each
    time). Equality is the old occupant's own, so a plugin cannot make its replacement
    compare equal, and only a plain True counts (tensors compare element-wise)."""
    if before is after:
        return True
    if type(before) is not type(after):
        return False
    try:
        return (before == after) is True
    except Exception:  # an __eq__ that refuses to compare: treat as changed
        return False


@dataclass
class Synthesis:
    """One timed synthesis. Times are seconds; audio is a CPU float32 waveform."""

    latency_s: float
    lm_s: float
    codec_s: float
    prefill_s: float | None
    prompt_tokens: int
    new_tokens: int
    frames: int
    stop_reason: str
    audio: np.ndarray
    sample_rate: int
    # Families whose generation is a fixed number of whole-sequence forwards (OmniVoice's
    # unmasking steps) report them and what one forward must move/compute at least.
    forward_passes: int | None = None
    forward_bytes: float | None = None
    forward_flops: float | None = None


@dataclass
class StreamRequest:
    """One stream of a serving workload: its prompt's token ids, how many frames it should
    produce (None: until the model stops it) and its sampling seed."""

    key: int
    prompt_ids: list[int]
    frames: int | None
    seed: int


class StreamServer(Protocol):
    """What the worker's load driver steps (running/serving.py `drive`): rows free for new
    streams, live streams, admission, and one step returning events with `.key`,
    `.frames_ready` (audio ready so far) and `.done`."""

    def free_rows(self) -> int: ...
    def live(self) -> int: ...
    def admit(self, reqs: list[Any]) -> int: ...
    def step(self) -> list[Any]: ...


@dataclass
class Serving:
    """A family's server for one serving workload, ready to be driven: the requests in
    arrival order, the frames each should produce, one frame's audio seconds, `warm_up`
    (graph capture and the like, untimed; returns what it captured) and what the server
    does, in words, for the record. `phases`, where the server times its work: seconds per
    named phase (each ended by a device sync) since warm-up, which `described["phases"]`
    defines. `memory`, where the server accounts for it: bytes it holds by what they are
    (the server's own definitions, kept with the record), asked inside `parked`.
    `parked`, where the server can: a context for the whole run (warm-up included) in which
    the model's weights it never reads are off the device (api/parking.py)."""

    server: StreamServer
    requests: list[StreamRequest]
    frames: list[int]
    frame_s: float
    warm_up: Callable[[], int]
    described: dict[str, str]
    phases: Callable[[], dict[str, float]] | None = None
    memory: Callable[[], dict[str, int]] | None = None
    parked: Callable[[], AbstractContextManager[Any]] | None = None


class Family(abc.ABC):
    """A model family: subclass, fill the class attributes, implement the five calls."""

    name: ClassVar[str]
    # Engine slots techniques may fill or wrap, in data-flow order; a glob ("knob.*")
    # declares a family of slots.
    slots: ClassVar[tuple[str, ...]]
    presets: ClassVar[tuple[str, ...]] = ()  # configs/models/<preset>.yaml of this family
    baseline: ClassVar[str] = "stock"  # the stack `orchestrate run` compares against
    workload: ClassVar[str] = "smoke"  # the workload `orchestrate run` uses by default
    # The baseline of a serving workload (one with a `load:`), whose stacks must all serve
    # many streams; None: the family serves one stream at a time.
    serving_baseline: ClassVar[str | None] = None
    # Audio seconds in one frame of a serving load's `frames` (its codec's frame rate).
    frame_s: ClassVar[float | None] = None
    summary: ClassVar[str] = ""

    @classmethod
    def declares(cls, slot: str) -> bool:
        return any(fnmatch.fnmatchcase(slot, pattern) for pattern in cls.slots)

    def random_weights(self, spec: ModelSpec) -> bool:
        """Whether `spec` builds random weights (ModelSpec: no `weights`), so quality scores of
        its audio mean nothing; a family whose models always carry trained weights says no."""
        return spec.weights is None

    def slot_occupants(self, engine: Any) -> dict[str, Any]:
        """What fills each declared slot of `engine` (for `orchestrate explain`): by default
        the engine attribute of the slot's name; families whose slots live elsewhere
        override this."""
        return {s: getattr(engine, s) for s in self.slots if hasattr(engine, s)}

    def apply_checked(self, engine: Any, technique: Technique) -> None:
        """`technique.apply(engine)`, refused (`UndeclaredSlot`) when it changed the occupant of
        a slot it declares neither in `slots` nor in `wraps`.

        Fidelity and `explain` trust the declarations: a technique that declares the head
        but also swaps the sampler had its logits teacher-forced against stock's, matched,
        and was reported exact while every sampled token differed (issue 36). Every
        family's `build_engine` applies techniques through this, so the declarations are
        checked against what `apply` really did, on the occupants `slot_occupants` reads.
        """
        before = self.slot_occupants(engine)
        technique.apply(engine)
        after = self.slot_occupants(engine)
        declared = (*technique.slots, *technique.wraps)
        missing = object()  # a slot that appeared or vanished changed too
        changed = [
            slot
            for slot in sorted(before.keys() | after.keys())
            if not _same(before.get(slot, missing), after.get(slot, missing))
        ]
        undeclared = [s for s in changed if not any(fnmatch.fnmatchcase(s, p) for p in declared)]
        if undeclared:
            raise UndeclaredSlot(technique.name, undeclared, declared)

    def slot_profile(
        self, engine: Any, text: str, seed: int, workload: Workload
    ) -> dict[str, float]:
        """Milliseconds per step each slot's part spends itself (its calls minus the slots
        it calls), over one short synthesis of `text`; the engine is left exactly as it
        was. The worker calls it after the timed rounds (JobSpec.profile_slots), stores
        `slot_ms.<slot>`, and the `profile` proposer targets the costliest slot.
        {} (this default) means "not profiled", never "free". See orchestrate.api.slot_clock.
        """
        return {}

    def serving(self, engine: Any, workload: Workload, streams: int) -> Serving:
        """A server over `engine` for `streams` streams of `workload` (which has a `load`).
        Families that serve many streams override this; the planner has already refused a
        serving workload on a stack without a technique that serves (`serves_streams`)."""
        raise Refused(f"the {self.name} family has no serving path (one stream at a time only)")

    @abc.abstractmethod
    def build_model(self, spec: ModelSpec) -> Any:
        """The model at `spec`'s shape (random weights) or from its local weights."""

    @abc.abstractmethod
    def config_hash(self, model: Any) -> str:
        """16 hex digits naming the architecture (see `configs_hash`)."""

    @abc.abstractmethod
    def build_engine(self, model: Any, stack: BuiltStack) -> Any:
        """Stock's engine with `stack`'s techniques applied in order."""

    @abc.abstractmethod
    def synthesize(self, engine: Any, text: str, seed: int, workload: Workload) -> Synthesis:
        """One timed synthesis, from prompt construction to the CPU waveform."""

    @abc.abstractmethod
    def step_bytes(self, engine: Any, context: float) -> int | None:
        """Fewest bytes one decode step must move at `context` positions; None if unknown."""

    @abc.abstractmethod
    def fidelity(
        self, model: Any, engines: dict[str, Any], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]:
        """Each engine's next-step distributions against stock's, teacher-forced."""
