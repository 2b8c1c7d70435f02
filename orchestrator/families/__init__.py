"""Model families: each builds its model, its stock engine, and times one synthesis.

A family is looked up by the name in ModelSpec.family / StackSpec.family; unknown names
fail at once with the list of known ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orchestrator.config import ModelSpec, Workload
from orchestrator.records import FidelityRecord
from orchestrator.registry import BuiltStack


def configs_hash(**configs: Any) -> str:
    """16 hex digits naming a model's architecture: its configs' dicts, keys sorted (the
    environment records it, so results of different shapes are never compared)."""
    blob = json.dumps({k: c.to_dict() for k, c in configs.items()}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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


class Family(Protocol):
    name: str

    def build_model(self, spec: ModelSpec) -> Any: ...

    def config_hash(self, model: Any) -> str: ...

    def build_engine(self, model: Any, stack: BuiltStack) -> Any: ...

    def synthesize(self, engine: Any, text: str, seed: int, workload: Workload) -> Synthesis: ...

    def step_bytes(self, engine: Any, context: float) -> int | None: ...

    def fidelity(
        self, model: Any, engines: dict[str, Any], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]: ...


def get_family(name: str) -> Family:
    if name == "rumik":
        from orchestrator.families.rumik import FAMILY

        return FAMILY
    if name == "omnivoice":
        try:
            from orchestrator.families.omnivoice import FAMILY as OMNIVOICE
        except ImportError as exc:  # torchaudio must match torch; see the README
            raise ValueError(f"the omnivoice family needs the omnivoice package: {exc}") from exc
        return OMNIVOICE
    raise ValueError(f"unknown model family {name!r}; known: rumik, omnivoice")
