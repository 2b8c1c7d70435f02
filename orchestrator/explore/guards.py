"""Guards: measurements an exploration refuses to believe, whatever their speed.

The known ways a search games a speed benchmark, each checked on every candidate after its
job, from what the result records carry:
- faster than the physical floor: time per token (or per forward) below what moving the
  bytes it must read takes at the bandwidth the worker measured (`fraction_of_floor`);
- audio that does not depend on its prompt or its seed (a cache, a constant output): judged
  against a reference in the same job (stock; in a dev job without stock, the champion,
  which passed these guards against stock before it was crowned), so a family that is
  deterministic by design (no sampling noise) is not accused of it;
- an exactness claim the measurement contradicts (declared exact, fidelity outside
  tolerance), and recordings the worker found broken (NaN, empty) where the reference's
  were not;
- whatever the worker itself flagged (`StackResult.invalid`: running.guards.mark).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from orchestrate.api.records import StackResult, UtteranceRecord
from orchestrate.running.metrics import is_valid

# The floor comes from a copy bandwidth measured once per job: a few percent of slack keeps
# a stack that sits right at the floor from being refused on the bandwidth probe's noise.
FLOOR_SLACK = 1.05
FLOOR_METRICS = {
    "fraction_of_floor": "time per token",
    "forward_fraction_of_floor": "time per forward",
}


def invalid_reasons(
    cand: StackResult,
    reference: StackResult,
    comparison: dict[str, float],
    audio_root: Path | None = None,
) -> list[str]:
    """Why `cand`'s measurement (against `reference`, stock or the champion, in the same
    job) is not to be believed; [] when every guard holds. `comparison`: the run's stored
    comparison of `cand`."""
    ref = reference.stack.name
    reasons = worker_flags(cand)
    for key, what in FLOOR_METRICS.items() if not reasons else ():  # the worker said it
        value = cand.metrics.get(key)
        if value is not None and value > FLOOR_SLACK:
            reasons.append(
                f"faster than the physical floor: {what} is {value:.2f}x the floor's speed "
                f"(bytes it must read / measured bandwidth); a timer or a cache is being fooled"
            )
    if comparison.get("exactness_failed") == 1.0:
        reasons.append("declared exact, but its fidelity against stock is outside tolerance")
    broken, ref_broken = _broken(cand.utterances), _broken(reference.utterances)
    if broken > ref_broken:
        reasons.append(f"{broken} broken recordings (NaN or empty audio), {ref} has {ref_broken}")
    same = cand.audio_independent_of_input  # the worker's own comparison (running.guards)
    if same is not None and reference.audio_independent_of_input is None:
        reasons.append(
            f"audio does not depend on its {same.differs_in}: {same.a} and {same.b} give the "
            f"same waveform, where {ref}'s differ"
        )
    elif same is None:
        reasons += independence(cand.utterances, reference.utterances, audio_root, ref)
    return reasons


def worker_flags(sr: StackResult) -> list[str]:
    """What the worker flagged on the result (`invalid`: why its timings cannot be real)."""
    return [f"flagged by the worker: {sr.invalid}"] if sr.invalid else []


def _broken(utts: Iterable[UtteranceRecord]) -> int:
    return sum(not is_valid(u) for u in utts)


def independence(
    cand: list[UtteranceRecord],
    reference: list[UtteranceRecord],
    audio_root: Path | None,
    ref_name: str = "stock",
) -> list[str]:
    """'does not depend on its seed / prompt' when the candidate's audio is the same across
    seeds (or prompts) where the reference's (`ref_name`), in the same job, differs."""
    mine, ref = _prints(cand, audio_root), _prints(reference, audio_root)
    out = []
    for axis, label in ((0, "prompt"), (1, "seed")):
        if _constant_along(mine, axis) and not _constant_along(ref, axis):
            out.append(
                f"audio does not depend on its {label}: identical output for different "
                f"{label}s, where {ref_name}'s differs"
            )
    return out


def _constant_along(prints: dict[tuple[str, int], str], axis: int) -> bool:
    """Whether outputs agree along `axis` (0: prompts, same seed; 1: seeds, same prompt) in
    every group with at least two members, and there is such a group."""
    groups: dict[Any, set[str]] = defaultdict(set)
    sizes: dict[Any, int] = defaultdict(int)
    for key, fp in prints.items():
        other = key[1 - axis]
        groups[other].add(fp)
        sizes[other] += 1
    judged = [g for g, n in sizes.items() if n > 1]
    return bool(judged) and all(len(groups[g]) == 1 for g in judged)


def _prints(utts: list[UtteranceRecord], audio_root: Path | None) -> dict[tuple[str, int], str]:
    """(prompt, seed) -> a fingerprint of its audio: the saved WAV's hash where there is one
    (first round), else what the record says about the waveform (frames, peak, clipping)."""
    out: dict[tuple[str, int], str] = {}
    for u in utts:
        key = (u.prompt_id, u.seed)
        if key in out:
            continue
        wav = audio_root / u.audio_path if audio_root and u.audio_path else None
        if wav is not None and wav.is_file():
            out[key] = hashlib.sha256(wav.read_bytes()).hexdigest()
        else:
            out[key] = f"{u.frames}:{u.peak_abs!r}:{u.clipped_samples}"
    return out
