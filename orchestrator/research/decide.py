"""Accept or retain: speed beyond the measured noise, every quality gate, and the record.

Speed is judged on the headline estimate, defined once in running.metrics (`paired_speedup`):
paired utterances (same prompt, seed and round, measured back to back in one interleaved
job), the per-utterance ratio baseline time / candidate time, averaged in log space with the
protocol's prompt weights (a weighted geometric mean), and a seeded percentile bootstrap
over the pairs for its confidence interval. A candidate is faster only when the
lower bound clears `speed.min_speedup`, which `orchestrate noise` sets from A/A runs.

Quality gates compare the candidate with stock on the same run's scored recordings; a gate
whose metric has no data fails (nothing is assumed to hold).
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from orchestrate.api.config import ModelSpec, StackSpec
from orchestrate.api.protocol import Protocol, QualitySpec, SpeedRule
from orchestrate.api.records import EnvironmentInfo, StackResult
from orchestrate.running import metrics
from orchestrate.running.metrics import bootstrap_speedup as bootstrap_speedup
from orchestrate.running.metrics import paired_log_ratios as paired_log_ratios
from orchestrate.running.metrics import prompt_weight as prompt_weight

if TYPE_CHECKING:
    from orchestrate.research.scoring_run import StackQuality
    from orchestrate.store.store import Store


# ------------------------------------------------------------------------------- speed


@dataclass(frozen=True)
class SpeedCheck:
    phase: str
    against: str
    n_pairs: int
    speedup: float
    ci_low: float
    ci_high: float
    confidence: float
    threshold: float
    rule: Literal["ci_low", "point"]  # which number must clear the threshold
    passed: bool

    def reason(self) -> str:
        if not self.n_pairs:
            return f"{self.phase}: no paired utterances against {self.against}"
        ci = f"{self.confidence:.0%} CI [{self.ci_low:.3f}, {self.ci_high:.3f}]"
        judged = "CI lower bound" if self.rule == "ci_low" else "speedup"
        verb = ">" if self.passed else "not >"
        return (
            f"{self.phase}: {self.speedup:.3f}x (paired) vs {self.against} ({ci}, "
            f"{self.n_pairs} pairs); {judged} {verb} {self.threshold:.3f}"
        )


def speed_check(
    phase: str,
    base: StackResult,
    cand: StackResult,
    rule: SpeedRule,
    metric: str = "rtf",
    judge_on: Literal["ci_low", "point"] = "ci_low",
    threshold: float | None = None,
) -> SpeedCheck:
    # The one headline estimate (running.metrics), so the gate's number is the stored one.
    paired = metrics.paired_speedup(base.utterances, cand.utterances, rule, metric)
    limit = rule.min_speedup if threshold is None else threshold
    if paired is None:
        nan = float("nan")
        return SpeedCheck(
            phase, base.stack.name, 0, nan, nan, nan, rule.confidence, limit, judge_on, False
        )
    judged = paired.lo if judge_on == "ci_low" else paired.speedup
    return SpeedCheck(
        phase,
        base.stack.name,
        paired.n,
        paired.speedup,
        paired.lo,
        paired.hi,
        rule.confidence,
        limit,
        judge_on,
        judged > limit,
    )


# ----------------------------------------------------------------------------- quality


@dataclass(frozen=True)
class GateCheck:
    metric: str
    bound: str
    stock: float | None
    candidate: float | None
    delta: float | None
    passed: bool
    why: str


def check_gates(stock: StackQuality, cand: StackQuality, spec: QualitySpec) -> list[GateCheck]:
    out = []
    for gate in spec.gates:
        s, c = stock.values.get(gate.metric), cand.values.get(gate.metric)
        needs_stock = gate.max_delta is not None or gate.min_delta is not None
        if c is None or (needs_stock and s is None):
            out.append(GateCheck(gate.metric, gate.describe(), s, c, None, False, "no scored data"))
            continue
        delta = None if s is None else c - s
        failures = []
        if gate.max_delta is not None and delta > gate.max_delta:  # type: ignore[operator]
            failures.append(f"Δ {delta:+.4g} > {gate.max_delta:+.4g}")
        if gate.min_delta is not None and delta < gate.min_delta:  # type: ignore[operator]
            failures.append(f"Δ {delta:+.4g} < {gate.min_delta:+.4g}")
        if gate.max_value is not None and c > gate.max_value:
            failures.append(f"{c:.4g} > {gate.max_value:.4g}")
        if gate.min_value is not None and c < gate.min_value:
            failures.append(f"{c:.4g} < {gate.min_value:.4g}")
        why = "; ".join(failures) or (f"Δ {delta:+.4g}" if delta is not None else f"{c:.4g}")
        out.append(GateCheck(gate.metric, gate.describe(), s, c, delta, not failures, why))
    return out


def check_coverage(stock: StackQuality, cand: StackQuality, spec: QualitySpec) -> GateCheck:
    extra = cand.coverage_failures - stock.coverage_failures
    limit = spec.max_new_coverage_failures
    why = f"{cand.coverage_failures} unscoreable vs stock's {stock.coverage_failures}"
    if cand.coverage_detail:
        why += f" ({'; '.join(cand.coverage_detail[:3])})"
    return GateCheck(
        "coverage",
        f"new failures ≤ {limit}",
        float(stock.coverage_failures),
        float(cand.coverage_failures),
        float(extra),
        extra <= limit,
        why,
    )


# ----------------------------------------------------------------------------- verdict


@dataclass
class Verdict:
    verdict: Literal["accept", "retain"]
    reasons: list[str]
    # Failure-ledger cause -> detail, for what only the decision knows (slower, gate, a
    # partial stack). A crash is in `failure`: the store ledgered it when the run was recorded.
    causes: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    speed: list[SpeedCheck] = field(default_factory=list)
    gates: list[GateCheck] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))


def judge(
    candidate: StackResult,
    speed: Sequence[SpeedCheck] = (),
    gates: Sequence[GateCheck] = (),
    flags: Sequence[str] = (),
    allow_flagged: bool = False,
    noisy: Sequence[str] = (),
) -> Verdict:
    """Accept only a candidate that ran whole, is faster beyond noise, holds every gate,
    was measured in a run that is not noisy (metrics.noise_reasons: its speed is not to be
    trusted either way), and (unless explicitly allowed) has not seen this holdout before."""
    from orchestrate.store.rows import classify_failure

    causes: dict[str, str] = {}
    reasons: list[str] = []
    failure = None
    if candidate.status in ("failed", "refused"):
        failure = "refused" if candidate.status == "refused" else classify_failure(candidate.error)
        reasons.append(f"{candidate.status} ({failure}): {candidate.error}")
    elif candidate.status == "partial":
        causes["refused"] = f"techniques skipped on this device: {candidate.skipped}"
        reasons.append(f"partial stack: skipped {sorted(candidate.skipped)}")
    slow = [s.reason() for s in speed if not s.passed]
    # A noisy run has not shown it is faster: ledgered as `slower` (the causes the store
    # knows), its detail saying why.
    slow += [f"noisy run, speed not established: {n}" for n in noisy]
    if slow:
        causes["slower"] = "; ".join(slow)
    failed = [f"{g.metric}: {g.why} (gate {g.bound})" for g in gates if not g.passed]
    if failed:
        causes["gate"] = "; ".join(failed)
    if flags and not allow_flagged:
        causes["gate"] = "; ".join([causes.get("gate", ""), *flags]).strip("; ")
    reasons += [s.reason() for s in speed]
    reasons += [f"{g.metric}: {'ok' if g.passed else 'FAIL'} {g.why}" for g in gates]
    reasons += [f"noisy run: {n}" for n in noisy]
    reasons += [f"holdout flag: {f}" for f in flags]
    if flags and allow_flagged:
        reasons.append("holdout flags overridden with --allow-holdout-reuse")
    verdict: Literal["accept", "retain"] = "retain" if causes or failure else "accept"
    return Verdict(verdict, reasons, causes, failure, list(speed), list(gates), list(flags))


# ---------------------------------------------------------------------------- champions


def hardware_key(env: EnvironmentInfo) -> str:
    return env.device_name + (f" x{env.gpu_count}" if env.gpu_count > 1 else "")


def local_hardware(device: str) -> str:
    """This host's hardware key, computed as environment.capture() names the device."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return torch.cuda.get_device_name() + (f" x{n}" if n > 1 else "")
    return platform.processor() or "cpu"


def model_key(spec: ModelSpec) -> str:
    return f"{spec.weights or spec.preset}:{spec.dtype}"


def current_champion(
    store: Store, family: str, model: str, workload: str, hardware: str
) -> dict[str, Any] | None:
    """The champion for this family, model, workload and hardware (its row), or None."""
    return store.current_champion(family, model, workload, hardware)


def champion_spec(champion: dict[str, Any]) -> StackSpec:
    return StackSpec.model_validate_json(champion["spec_json"])


def list_champions(store: Store) -> list[dict[str, Any]]:
    """Every champion, oldest first."""
    return store.list_champions()


def registry_name(family: str, model: str, workload: str, hardware: str) -> str:
    raw = f"orchestrate.{family}.{model}.{workload}.{hardware}"
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", raw)


def record(
    store: Store,
    *,
    run_id: str,
    stack: StackSpec,
    verdict: Verdict,
    protocol: Protocol,
    family: str,
    model: str,
    workload: str,
    hardware: str,
    speedup: float,
    evidence: dict[str, Any],
    mlflow_stack_run: str | None = None,
) -> dict[str, Any]:
    """Store a verdict: a decisions row, failure-ledger rows for a retain, and for an
    accept a champions row (plus an MLflow registry alias when the run was tracked)."""
    # One transaction: the decision and, for an accept, the champion it crowns.
    decision_id, champion_id = store.record_decision(
        run_id=run_id,
        stack=stack,
        verdict=verdict.verdict,
        reasons={**verdict.to_dict(), **evidence},
        protocol_hash=protocol.content_hash(),
        family=family,
        model=model,
        workload=workload,
        hardware=hardware,
        speedup=speedup,
    )
    out: dict[str, Any] = {
        "decision_id": decision_id,  # None: a worker that died outright left nothing to judge
        "champion": champion_id,
        "mlflow_model": None,
    }
    for cause, detail in verdict.causes.items():
        store.record_failure(stack.name, cause, detail, run_id)
    if verdict.verdict == "accept" and mlflow_stack_run:
        from orchestrate.store import tracking

        name = registry_name(family, model, workload, hardware)
        out["mlflow_model"] = tracking.mark_champion(
            name, mlflow_stack_run, {"stack": stack.name, "protocol": protocol.content_hash()}
        )
        store.set_champion_mlflow_model(out["champion"], out["mlflow_model"])
    return out


def list_decisions(store: Store, workload: str | None = None) -> list[dict[str, Any]]:
    """Verdicts, oldest first, with the stack they judged and the run it was measured in."""
    return store.list_decisions(workload)
