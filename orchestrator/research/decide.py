"""Accept or retain: speed beyond the measured noise, every quality gate, and the record.

Speed is judged on the headline estimate, defined once in running.metrics (`paired_speedup`):
paired utterances (same prompt, seed and round, measured back to back in one interleaved
job), the per-utterance ratio baseline time / candidate time, averaged in log space with the
protocol's prompt weights (a weighted geometric mean), and a seeded percentile bootstrap
over the pairs for its confidence interval. A candidate is faster only when the
lower bound clears `speed.min_speedup`, which `orchestrate noise` sets from A/A runs.

Quality gates compare the candidate with stock on the same run's scored recordings; a gate
whose metric has no data fails (nothing is assumed to hold). On random weights (the family
says: `Family.random_weights`) the audio does not depend on the prompt, so no quality gate is
judged: each says NOT_MEANINGFUL, and speed decides alone.

The headline of a decision is the stored paired estimate of the run it was made on
(`run_headline`): for a holdout decision, and so for every champion, the holdout's, labelled
"holdout paired"; never the dev remeasure the holdout was opened on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from orchestrate.api.config import ModelSpec, StackSpec
from orchestrate.api.protocol import Protocol, QualitySpec, SpeedRule, split_phase
from orchestrate.api.records import StackResult
from orchestrate.api.registry import StackError, get_family
from orchestrate.running import metrics
from orchestrate.running.environment import hardware_key as hardware_key
from orchestrate.running.environment import local_hardware as local_hardware
from orchestrate.running.metrics import bootstrap_speedup as bootstrap_speedup
from orchestrate.running.metrics import paired_log_ratios as paired_log_ratios
from orchestrate.running.metrics import prompt_weight as prompt_weight
from orchestrate.store.decisions import NOISE_BAR

if TYPE_CHECKING:
    from orchestrate.research.scoring_run import StackQuality
    from orchestrate.store.store import Store

NOT_MEANINGFUL = "not meaningful: random weights"
REUSE_OVERRIDE = "--allow-holdout-reuse"


def random_weights(spec: ModelSpec) -> bool:
    """Whether `spec` builds random weights, as its family says (Piper's are always trained);
    a family not installed here falls back on ModelSpec's rule: no `weights`, random."""
    try:
        return get_family(spec.family).random_weights(spec)
    except StackError:
        return spec.weights is None


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
    passed: bool | None  # None: not judged (random weights); the numbers are kept, as data
    why: str

    @property
    def status(self) -> str:
        return NOT_MEANINGFUL if self.passed is None else "ok" if self.passed else "FAIL"

    def line(self) -> str:
        if self.passed is None:
            return f"{self.metric}: {self.why}"
        return f"{self.metric}: {self.status} {self.why}"

    def not_judged(self) -> GateCheck:
        return replace(self, passed=None, why=NOT_MEANINGFUL)


def check_gates(
    stock: StackQuality, cand: StackQuality, spec: QualitySpec, random_weights: bool = False
) -> list[GateCheck]:
    """Each gate of `spec` on the candidate against stock; none judged on random weights."""
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
    return [g.not_judged() for g in out] if random_weights else out


def check_coverage(
    stock: StackQuality, cand: StackQuality, spec: QualitySpec, random_weights: bool = False
) -> GateCheck:
    # Scoreable means "speech the scorers could hear": random weights make none.
    extra = cand.coverage_failures - stock.coverage_failures
    limit = spec.max_new_coverage_failures
    why = f"{cand.coverage_failures} unscoreable vs stock's {stock.coverage_failures}"
    if cand.coverage_detail:
        why += f" ({'; '.join(cand.coverage_detail[:3])})"
    check = GateCheck(
        "coverage",
        f"new failures ≤ {limit}",
        float(stock.coverage_failures),
        float(cand.coverage_failures),
        float(extra),
        extra <= limit,
        why,
    )
    return check.not_judged() if random_weights else check


# ----------------------------------------------------------------------------- verdict


@dataclass
class Verdict:
    verdict: Literal["accept", "retain"]
    reasons: list[str]
    # Failure-ledger cause -> detail, for what only the decision knows (slower, below the
    # noise bar, gate, a partial stack). A crash is in `failure`: the store ledgered it when
    # the run was recorded.
    causes: dict[str, str] = field(default_factory=dict)
    failure: str | None = None
    speed: list[SpeedCheck] = field(default_factory=list)
    gates: list[GateCheck] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    overridden: list[str] = field(default_factory=list)  # flags accepted anyway, and by what
    quality: str = "judged"  # or NOT_MEANINGFUL, or "not judged" (no gate reached)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))


def speed_cause(check: SpeedCheck) -> str:
    """Why a failed speed check failed, as a fact: `slower` when the paired estimate is not
    above 1 (or there were no pairs), NOISE_BAR when it is faster than what it was measured
    against but its CI did not clear the protocol's min_speedup."""
    faster = check.n_pairs > 0 and check.speedup > 1.0 and check.ci_high >= 1.0
    return NOISE_BAR if faster else "slower"


def judge(
    candidate: StackResult,
    speed: Sequence[SpeedCheck] = (),
    gates: Sequence[GateCheck] = (),
    flags: Sequence[str] = (),
    allow_flagged: bool = False,
    noisy: Sequence[str] = (),
    random_weights: bool = False,
) -> Verdict:
    """Accept only a candidate that ran whole, whose timings are not faster than their floor
    (metrics.invalid_reasons: `other`), is faster beyond noise, holds every gate,
    was measured in a run that is not noisy (metrics.noise_reasons: its speed is not to be
    trusted either way), and (unless explicitly allowed) has not seen this holdout before.
    On random weights no quality gate is judged (each says NOT_MEANINGFUL): speed decides."""
    from orchestrate.store.rows import classify_failure

    if random_weights:
        gates = [g.not_judged() for g in gates]
    causes: dict[str, str] = {}
    reasons: list[str] = []
    failure = None
    if candidate.status in ("failed", "refused"):
        failure = "refused" if candidate.status == "refused" else classify_failure(candidate.error)
        reasons.append(f"{candidate.status} ({failure}): {candidate.error}")
    elif candidate.status == "partial":
        causes["refused"] = f"techniques skipped on this device: {candidate.skipped}"
        reasons.append(f"partial stack: skipped {sorted(candidate.skipped)}")
    if invalid := metrics.invalid_reasons(candidate.metrics, candidate.invalid):  # not real
        causes["other"] = "; ".join(f"INVALID: {r}" for r in invalid)
        reasons += [f"INVALID: {r}" for r in invalid]
    for check in (s for s in speed if not s.passed):
        cause = speed_cause(check)
        causes[cause] = "; ".join(filter(None, [causes.get(cause), check.reason()]))
    if noisy:  # not shown to be faster: `slower` (README), the detail saying why
        noise = "; ".join(f"noisy run, speed not established: {n}" for n in noisy)
        causes["slower"] = "; ".join(filter(None, [causes.get("slower"), noise]))
    failed = [f"{g.metric}: {g.why} (gate {g.bound})" for g in gates if g.passed is False]
    if failed:
        causes["gate"] = "; ".join(failed)
    if flags and not allow_flagged:
        causes["gate"] = "; ".join([causes.get("gate", ""), *flags]).strip("; ")
    overridden = [f"{f} ({REUSE_OVERRIDE})" for f in flags] if allow_flagged else []
    quality = NOT_MEANINGFUL if random_weights else "judged" if gates else "not judged"
    reasons += [s.reason() for s in speed]
    reasons += [g.line() for g in gates]
    if random_weights:
        reasons.append(f"quality not judged ({NOT_MEANINGFUL}): speed decides")
    reasons += [f"noisy run: {n}" for n in noisy]
    reasons += [f"holdout flag: {f}" for f in flags]
    if overridden:
        reasons.append(f"holdout flags overridden with {REUSE_OVERRIDE}: {'; '.join(flags)}")
    verdict: Literal["accept", "retain"] = "retain" if causes or failure else "accept"
    return Verdict(
        verdict, reasons, causes, failure, list(speed), list(gates), list(flags), overridden,
        quality,
    )  # fmt: skip


# ---------------------------------------------------------------------------- champions


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


def run_headline(store: Store, run_id: str, spec_hash: str) -> dict[str, Any]:
    """The stored headline (metrics.headline: paired, bootstrap CI) of one stack in one run,
    labelled by the run's phase ("holdout paired", "remeasure paired", "dev paired");
    {} when the run or the stack's pairs are not there."""
    from orchestrate.store.errors import StoreError

    try:
        run = store.get_run(run_id, utterances=False)
    except (StoreError, LookupError):
        return {}
    found = next((st for st in run["stacks"] if st["spec_hash"] == spec_hash), None)
    keys = [metrics.HEADLINE, *(f"{metrics.HEADLINE}_{k}" for k in ("lo", "hi", "n"))]
    stored = {k: found["metrics"][k] for k in keys if found and k in found["metrics"]}
    if not stored:
        return {}
    return stored | {"label": f"{split_phase(run['workload_name'])[1]} paired", "run_id": run_id}


def decision_view(store: Store, decision: dict[str, Any]) -> dict[str, Any]:
    """What a report shows of a decision (a list_decisions row): its headline (the stored
    paired estimate of the run it was made on, labelled: a champion's is its holdout's), the
    flags it overrode, whether quality was judged, and why, in one line. Decisions stored
    before these were recorded get them from their run."""
    why = decision["reasons"]
    headline = why.get("decision_headline") or run_headline(
        store, decision["run_id"], decision["spec_hash"]
    )
    overridden = why.get("overridden")
    if overridden is None:  # older rows: an accept with flags was an override
        flags = why.get("flags") or []
        overridden = list(flags) if decision["verdict"] == "accept" else []
    quality = why.get("quality") or _run_quality(store, decision["run_id"])
    parts = [f"{k}: {v}" for k, v in (why.get("causes") or {}).items()]
    if why.get("failure"):
        parts.insert(0, f"failed ({why['failure']})")
    parts += [f"overridden: {o}" for o in overridden]
    if quality == NOT_MEANINGFUL:
        parts.append(f"quality not judged ({NOT_MEANINGFUL})")
    held = decision["verdict"] == "accept" and not parts
    line = "every gate held" if held else "; ".join(parts)
    return {"headline": headline, "overridden": overridden, "quality": quality, "why": line}


def _run_quality(store: Store, run_id: str) -> str:
    from orchestrate.store.errors import StoreError

    try:
        spec = ModelSpec.model_validate(store.get_run(run_id, utterances=False)["model"])
    except (StoreError, LookupError, ValueError):
        return "judged"
    return NOT_MEANINGFUL if random_weights(spec) else "judged"


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
    accept a champions row; then (best effort) the verdict on the stack's MLflow run and,
    for an accept, a registered model version with the `champion` alias.

    The decision's headline is the stored paired estimate of `run_id` (run_headline): for
    the holdout decision that crowns a champion, the holdout's. `speedup` is used only where
    that run stored none."""
    headline = run_headline(store, run_id, stack.content_hash())
    reasons = {**verdict.to_dict(), **evidence, "decision_headline": headline}
    # One transaction: the decision and, for an accept, the champion it crowns.
    decision_id, champion_id = store.record_decision(
        run_id=run_id,
        stack=stack,
        verdict=verdict.verdict,
        reasons=reasons,
        protocol_hash=protocol.content_hash(),
        family=family,
        model=model,
        workload=workload,
        hardware=hardware,
        speedup=headline.get(metrics.HEADLINE, speedup),
    )
    out: dict[str, Any] = {
        "decision_id": decision_id,  # None: a worker that died outright left nothing to judge
        "champion": champion_id,
        "headline": headline,
        "mlflow_model": None,
    }
    for cause, detail in verdict.causes.items():
        store.record_failure(stack.name, cause, detail, run_id)
    mlflow_stack_run = mlflow_stack_run or _mlflow_stack_run(store, run_id, stack)
    if mlflow_stack_run:
        try:
            out["mlflow_model"] = _track(
                reasons, mlflow_stack_run, stack, protocol, (family, model, workload, hardware)
            )
        except Exception as exc:  # the database holds the decision; MLflow is best effort
            out["mlflow_warning"] = f"MLflow: {type(exc).__name__}: {exc}".splitlines()[0]
        if out["mlflow_model"]:
            store.set_champion_mlflow_model(out["champion"], out["mlflow_model"])
    return out


def _mlflow_stack_run(store: Store, run_id: str, stack: StackSpec) -> str | None:
    """The stack's MLflow run in `run_id`, when that run was tracked."""
    from orchestrate.store.errors import StoreError

    try:
        stacks = store.get_run(run_id, utterances=False)["stacks"]
    except (StoreError, LookupError):
        return None
    spec_hash = stack.content_hash()
    return next((s["mlflow_run_id"] for s in stacks if s["spec_hash"] == spec_hash), None)


def _track(
    reasons: dict[str, Any],
    stack_run: str,
    stack: StackSpec,
    protocol: Protocol,
    key: tuple[str, str, str, str],
) -> str | None:
    """The verdict onto the gated stack's MLflow run; an accept as a registered model
    version (tags: the holdout paired headline and CI, flags overridden, quality)."""
    from orchestrate.store import tracking

    tracking.log_decision(stack_run, reasons)
    if reasons["verdict"] != "accept":
        return None
    tags = tracking.decision_tags(reasons) | {
        "stack": stack.name,
        "protocol": protocol.content_hash(),
    }
    return tracking.mark_champion(registry_name(*key), stack_run, tags)


def list_decisions(store: Store, workload: str | None = None) -> list[dict[str, Any]]:
    """Verdicts, oldest first, with the stack they judged and the run it was measured in."""
    return store.list_decisions(workload)
