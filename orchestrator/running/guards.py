"""Checks on what the worker measures, so a number that cannot be real is never reported as
one (the kernel-benchmark leaderboards' lessons):

- an utterance's time ends after its waveform is on the host and checked, finite and not
  empty (`check_waveform`); a waveform that fails is that utterance's error;
- audio that does not depend on its input (two prompts or seeds, one waveform) is flagged
  on the stack (`AudioPrints`);
- a fidelity check that fails is the failing stack's own error, not every stack's silence
  (`fidelity_per_stack`);
- timings faster than their floor mark the stack invalid (`mark`, metrics.floor_violations).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrate.api.family import Synthesis
from orchestrate.api.records import FidelityRecord, IdenticalAudio, StackResult
from orchestrate.running import metrics

# Near-identical: what float rounding of one computation could give, not two renditions.
MAX_ABS_DIFF = 1e-4
MIN_CORRELATION = 0.999
# Lengths further apart than this already depend on the input (a model-decided length).
MAX_LENGTH_GAP = 0.1
PRINT_RATE = 2000  # samples per second each utterance's print keeps (every k-th sample)


class BadWaveform(ValueError):
    """A timed synthesis whose waveform is not a finite, non-empty host array."""


def check_waveform(syn: Synthesis) -> None:
    """Raise BadWaveform unless `syn.audio` is a non-empty, finite numpy (host) waveform.

    Families stop their timer once the waveform is on the host; this check runs right
    after, and its own time is added to the utterance (latency and codec time), so the
    timed region ends after the waveform is checked, as the README's timer scope says."""
    t0 = time.perf_counter()
    audio = syn.audio
    if not isinstance(audio, np.ndarray):
        raise BadWaveform(f"the waveform is a {type(audio).__name__}, not a host numpy array")
    if audio.size == 0:
        raise BadWaveform("empty waveform")
    bad = audio.size - int(np.count_nonzero(np.isfinite(audio)))
    if bad:
        raise BadWaveform(f"non-finite waveform: {bad} of {audio.size} samples are NaN or inf")
    spent = time.perf_counter() - t0
    syn.latency_s += spent
    syn.codec_s += spent


@dataclass
class _Print:
    label: str  # prompt/seed
    text: str
    seed: int
    round: int
    length: int
    md5: str
    samples: np.ndarray  # every k-th sample, float32


@dataclass
class AudioPrints:
    """Per stack, a compact print of each timed waveform (md5 and every k-th sample), kept
    to find two utterances from different inputs whose audio is the same."""

    by_stack: dict[str, list[_Print]] = field(default_factory=dict)

    def add(
        self, stack: str, prompt_id: str, text: str, seed: int, rnd: int, audio: np.ndarray,
        sample_rate: int,
    ) -> None:  # fmt: skip
        step = max(1, sample_rate // PRINT_RATE)
        self.by_stack.setdefault(stack, []).append(
            _Print(
                f"{prompt_id}/seed {seed}", text, seed, rnd, int(audio.size),
                hashlib.md5(audio.tobytes()).hexdigest(), np.array(audio[::step], np.float32),
            )
        )  # fmt: skip

    def find(self, stack: str) -> IdenticalAudio | None:
        """A pair of the stack's utterances with different inputs and the same audio;
        pairs differing in prompt text first (the worse finding), else None."""
        pairs = [
            (a, b)
            for a, b in itertools.combinations(self.by_stack.get(stack, []), 2)
            if (a.text, a.seed) != (b.text, b.seed)
        ]
        pairs.sort(key=lambda p: p[0].text == p[1].text)  # different prompts first
        for a, b in pairs:
            if found := _same(a, b):
                return found
        return None


def _same(a: _Print, b: _Print) -> IdenticalAudio | None:
    if min(a.length, b.length) < (1 - MAX_LENGTH_GAP) * max(a.length, b.length):
        return None
    n = min(a.samples.size, b.samples.size)
    x, y = a.samples[:n].astype(np.float64), b.samples[:n].astype(np.float64)
    diff = float(np.abs(x - y).max()) if n else 0.0
    corr = float(np.corrcoef(x, y)[0, 1]) if n > 1 and x.std() > 0 and y.std() > 0 else None
    same = (a.md5 == b.md5) or diff < MAX_ABS_DIFF or (corr is not None and corr > MIN_CORRELATION)
    if not same:
        return None
    differs = [w for w, d in (("prompt", a.text != b.text), ("seed", a.seed != b.seed)) if d]
    return IdenticalAudio(
        a=a.label, b=b.label, round_a=a.round, round_b=b.round,
        differs_in=" and ".join(differs),  # type: ignore[arg-type]
        max_abs_diff=diff, correlation=corr,
    )  # fmt: skip


def fidelity_per_stack(
    family: Any,
    model: Any,
    engines: dict[str, Any],
    workload: Any,
    steps: int,
    describe: Callable[[BaseException], str],
) -> tuple[dict[str, FidelityRecord], dict[str, str]]:
    """(records, errors) by stack. All engines in one call first (the family builds stock's
    reference once); when that call raises, each engine alone, so one stack's failure is
    that stack's error. A stack the family answered nothing for says so too."""
    found: dict[str, FidelityRecord] = {}
    errors: dict[str, str] = {}
    try:
        found = dict(family.fidelity(model, engines, workload, steps))
    except Exception:
        for name, engine in engines.items():
            try:
                found.update(family.fidelity(model, {name: engine}, workload, steps))
            except Exception as exc:
                errors[name] = describe(exc)
    for name in engines:
        if name not in found and name not in errors:
            errors[name] = "the family's fidelity returned no record for this stack"
    return {n: r for n, r in found.items() if n in engines}, errors


def mark(res: StackResult) -> None:
    """Set the stack's `invalid` from its metrics, and put each guard's verdict into its
    metrics too (the store keeps metrics, not these fields): `invalid`, the same-audio flag
    with the two rounds, `fidelity_failed`."""
    res.invalid = "; ".join(metrics.floor_violations(res.metrics)) or None
    flags: dict[str, float] = {}
    if res.invalid:
        flags[metrics.INVALID] = 1.0
    if (same := res.audio_independent_of_input) is not None:
        flags[metrics.SAME_AUDIO] = 1.0
        rounds = (float(same.round_a), float(same.round_b))
        flags.update(zip(metrics.SAME_AUDIO_ROUNDS, rounds, strict=True))
    if res.fidelity_error:
        flags[metrics.FIDELITY_FAILED] = 1.0
    res.metrics.update(flags)
