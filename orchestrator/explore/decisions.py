"""What the exploration decides about one measured candidate: pure functions of the job's
result, the protocol and what the guards found, so every rule can be tested on fabricated
records (tests/test_explore.py) and reads in one place.

A candidate goes dev -> fresh -> gate, and is judged after each:
- dev: measured in one job with its parent (the champion; stock only while stock is the
  champion or a proposer reads headlines: explore.jobs). Faster than the parent
  beyond the protocol's noise bar (the paired CI's lower bound > speed.min_speedup), or
  measured in a noisy job whose CI still reaches above the bar (noise settles nothing either
  way), and its quality path holds: `remeasure`; a crash: `error`; a guard: `invalid`; else
  `drop`.
- fresh: the same job on fresh seeds (never the workload's). Still faster beyond the bar
  and not noisy: `gate`. Noisy but possibly faster: `remeasure` once more on other fresh
  seeds (a contended machine must not ledger a real gain as lost: the identity of a
  dropped candidate is never run again), or `drop` (cause NOISY) when that was the retry;
  else `drop`.
- gate: research.gate.run_gate decides `accept` or `retain` (the holdout opens only there).

Quality paths: a stack whose techniques all declare exact needs its exactness measured
(fidelity within tolerance; a failed claim is a guard). An approximate stack on random
weights can pass only through the protocol's fidelity thresholds (gates on `fidelity_*`
metrics), judged here on the dev job's fidelity; with real weights the gate's quality gates
judge it. A stack with a technique in a slot its fidelity comparison never ran (the
record's `not_covered`: a step schedule, a codec) has nothing measured there, so on random
weights it is not judged at all, whatever its plugin declares. Every decision says which
path judged it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate.api import protocol as proto
from orchestrate.api.proposer import Decision
from orchestrate.api.protocol import Protocol
from orchestrate.api.records import FidelityRecord, StackResult
from orchestrate.research import decide
from orchestrate.research.scoring_run import StackQuality
from orchestrate.running import metrics
from orchestrate.store.decisions import NOISY

EXACT = "exact: fidelity measured within tolerance"
FIDELITY = "approximate on random weights: the protocol's fidelity thresholds"
QUALITY = "the gate's quality gates (real weights)"
NOT_JUDGED = "none: quality cannot be judged"

NEXT_PHASE = {"remeasure": "fresh", "gate": "gate"}  # decision -> the phase it sends to


@dataclass(frozen=True)
class Step:
    """One decision on a candidate, with its numbers and the ledger cause of a rejection."""

    phase: str  # plan | dedup | dev | fresh | gate | proposer
    decision: Decision
    reason: str
    cause: str | None = None  # failures-ledger cause (decide.NOISE_BAR, slower, gate, ...)
    quality_path: str | None = None
    numbers: dict[str, float] = field(default_factory=dict)
    run_id: str | None = None  # the run it was decided on
    other_runs: list[str] = field(default_factory=list)  # e.g. the gate's remeasure

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge_measured(
    phase: str,
    cand: StackResult,
    parent: StackResult,
    reference: StackResult,
    protocol: Protocol,
    *,
    invalid: list[str],
    noisy: list[str],
    random_weights: bool,
    change: str = "",
    retry_noise: bool = False,
) -> Step:
    """The decision after a dev or fresh job: error, invalid, drop, remeasure or gate.
    `reference`: what the fidelity thresholds compare against (stock; the champion in a dev
    job without stock). `retry_noise`: a noisy fresh job may send the candidate to one
    more (its first did)."""
    if cand.status in ("failed", "refused"):
        return Step(phase, "error", f"{cand.status}: {cand.error}")
    if cand.status == "partial":
        skipped = ", ".join(f"{k} ({v})" for k, v in cand.skipped.items())
        return Step(phase, "error", f"partial: skipped on this device: {skipped}", "refused")
    if parent.status in ("failed", "refused") or not parent.utterances:
        return Step(phase, "error", f"its parent {parent.stack.name} failed in this job")
    if invalid:
        return Step(phase, "invalid", "; ".join(invalid), "gate")
    check = decide.speed_check(phase, parent, cand, protocol.speed, protocol.speed_metric)
    numbers = speed_numbers(check)
    noise = f"noisy run, speed not established: {'; '.join(noisy)}"
    # A noisy job establishes nothing either way: one that may still be faster (its CI
    # reaches above the bar) goes to a fresh-seed job, which must be clean to pass; a noisy
    # fresh job gets one more, and a second noisy one drops it as noisy, not as slower.
    maybe = bool(noisy) and check.n_pairs > 0 and check.ci_high > check.threshold
    if maybe and phase != "dev" and not retry_noise:
        return Step(phase, "drop", f"{check.reason()}; {noise}", NOISY, numbers=numbers)
    if not check.passed and not maybe:
        why = check.reason() + ablation_note(change, check) + (f"; {noise}" if noisy else "")
        return Step(phase, "drop", why, decide.speed_cause(check), numbers=numbers)
    path, why_not = quality_path(cand, reference, protocol, random_weights)
    if why_not:
        return Step(phase, "drop", f"{check.reason()}; {why_not}", "gate", path, numbers)
    nxt: Decision = "remeasure" if phase == "dev" or noisy else "gate"
    why = f"{check.reason()}; quality: {path}"
    if noisy:
        again = "fresh seeds settle it" if phase == "dev" else "one more fresh job settles it"
        why += f"; noisy run ({'; '.join(noisy)}): {again}"
    return Step(phase, nxt, why, None, path, numbers)


def speed_numbers(check: decide.SpeedCheck) -> dict[str, float]:
    return {
        "vs_parent": check.speedup,
        "vs_parent_lo": check.ci_low,
        "vs_parent_hi": check.ci_high,
        "pairs": float(check.n_pairs),
        "min_speedup": check.threshold,
    }


def ablation_note(change: str, check: decide.SpeedCheck) -> str:
    """For a leave-one-out candidate ('-name') that is not faster: whether `name` pays."""
    if not change.startswith("-") or not check.n_pairs:
        return ""
    name = change[1:]
    if check.ci_low <= 1.0 <= check.ci_high:
        return f"; {name} does not pay here: leaving it out costs nothing measurable"
    if check.ci_high < 1.0:
        return f"; {name} pays: leaving it out is slower"
    return ""


def quality_path(
    cand: StackResult, reference: StackResult, protocol: Protocol, random_weights: bool
) -> tuple[str, str | None]:
    """(which path judges the candidate's quality, why it fails there or None)."""
    unseen = _unseen(cand.fidelity)
    if cand.exact and cand.fidelity is not None and not unseen:
        return EXACT, None  # within tolerance, or the exactness guard has refused it
    if not random_weights:
        return QUALITY, None
    if unseen:  # what fidelity never ran, no threshold on it can vouch for
        claim = "declared exact" if cand.exact else "approximate"
        return NOT_JUDGED, (
            f"{claim}, but fidelity never ran {unseen}: what changes there is the plugin's "
            "word, and quality cannot be judged on random weights"
        )
    if cand.exact:
        return NOT_JUDGED, (
            "declared exact but exactness was not measured (no fidelity record), and quality "
            "cannot be judged on random weights"
        )
    gates = fidelity_gates(protocol)
    if not gates:
        return NOT_JUDGED, (
            f"approximate on random weights, and protocol {proto.label(protocol)} sets no "
            "fidelity thresholds (gates on fidelity_* metrics): its quality cannot be judged"
        )
    if cand.fidelity is None:
        return FIDELITY, "approximate on random weights and no fidelity was measured"
    spec = protocol.quality.model_copy(update={"gates": gates})
    before = _quality(reference.fidelity, spec)
    checks = decide.check_gates(before, _quality(cand.fidelity, spec), spec)
    failed = [f"{c.metric}: {c.why} (gate {c.bound})" for c in checks if c.passed is False]
    if failed:
        return FIDELITY, "fidelity thresholds not held: " + "; ".join(failed)
    return FIDELITY, None


def _unseen(fidelity: FidelityRecord | None) -> str:
    """The slots a stack filled that its fidelity comparison never ran ("" when none)."""
    if fidelity is None or not fidelity.not_covered:
        return ""
    return ", ".join(f"{slot} ({tech})" for slot, tech in sorted(fidelity.not_covered.items()))


def fidelity_gates(protocol: Protocol) -> list[Any]:
    metrics_ = protocol.quality.metrics
    return [g for g in protocol.quality.gates if metrics_[g.metric].source == "fidelity"]


def _quality(fidelity: FidelityRecord | None, spec: Any) -> StackQuality:
    values = {}
    for name, metric in spec.metrics.items():
        if metric.source == "fidelity" and fidelity is not None:
            values[name] = float(getattr(fidelity, metric.value))
    return StackQuality(values=values)


def unjudged_gains(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored candidates dropped only because their quality could not be judged, though
    faster than their parent beyond the bar (CI lower bound): what a quality gate on real
    weights could still accept (fewer diffusion steps on random weights, say)."""
    out = []
    for c in candidates:
        if c["decision"] != "drop" or c.get("quality_path") != NOT_JUDGED or not c["steps"]:
            continue
        bar = c["steps"][-1].get("numbers", {}).get("min_speedup")
        if bar is not None and (c.get("vs_parent_lo") or 0.0) > bar:
            out.append(c)
    return out


def judge_gate(report: dict[str, Any]) -> Step:
    """The decision the gate took (research.gate.run_gate's report), as a step."""
    verdict = report.get("verdict") or {}
    decision: Decision = "accept" if verdict.get("verdict") == "accept" else "retain"
    reasons = [r for r in verdict.get("reasons", []) if r]
    if verdict.get("failure"):
        reasons.insert(0, f"failed ({verdict['failure']})")
    own_remeasure = report.get("remeasure_from", "this gate") == "this gate"
    if not own_remeasure and report.get("remeasure_run"):
        reasons.insert(0, f"remeasure: the fresh-seed run {report['remeasure_run'][:12]}")
    headline = (report.get("record") or {}).get("headline") or report.get("headline") or {}
    numbers = headline_numbers(headline)
    return Step(
        "gate",
        decision,
        "; ".join(reasons) or decision,  # they say whether and how quality was judged
        None,  # run_gate has written its own decision and ledger rows
        None,  # the path that judged quality was chosen before the gate (quality_path)
        numbers,
        report.get("holdout_run") or report.get("remeasure_run"),
        [report["remeasure_run"]]  # a fresh run standing in is the candidate's already
        if report.get("holdout_run") and report.get("remeasure_run") and own_remeasure
        else [],
    )


def headline_numbers(stored: dict[str, Any]) -> dict[str, float]:
    """A stored headline (paired speedup vs stock and its CI: `speedup_paired`, `_lo`, `_hi`)
    as a candidate's numbers (`headline`, `headline_lo`, `headline_hi`)."""
    names = {
        metrics.HEADLINE: "headline",
        f"{metrics.HEADLINE}_lo": "headline_lo",
        f"{metrics.HEADLINE}_hi": "headline_hi",
    }
    return {names[k]: float(v) for k, v in stored.items() if k in names}
