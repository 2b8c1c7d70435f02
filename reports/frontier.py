"""Speed frontier and speed-versus-quality Pareto set, from stored records only.

Every stack measured against stock on one workload (development ladder, remeasure and
holdout runs; not noise runs), under one protocol version, on one model and hardware, is an
experiment point in time order. A point is:
- 'pass': its run's scores hold every protocol gate (and coverage), or, unscored, the stack
  is exact and inside fidelity tolerance (its outputs are stock's by construction);
- 'alert': a gate or coverage fails on its scores, an exact stack left fidelity tolerance,
  the stack failed a phase gate on quality, or it was flagged for holdout reuse;
- 'unverified': approximate (or declared exact with fidelity not measured) and unscored:
  its speed says nothing about its quality yet.
A point from a noisy run (metrics.noise_reasons) is an 'alert' too: its speed is not to be
trusted. On random weights no point is judged on quality (Family.random_weights): an exact
stack inside fidelity tolerance passes, an approximate one stays 'unverified' ("quality not
meaningful: random weights").

The frontier is built from gate decisions (under this protocol, on runs in scope): the
cumulative best of accepted stacks, each at the headline of the run it was accepted on, its
holdout paired estimate; flags the decision overrode are named with it. A stack the gate
retained is an 'alert' (with the gate's why) and never the best. Stacks never gated are
shown apart, as `dev_only`: the cumulative best of their 'pass' points, labelled "dev only,
not gated". A point's speedup is the headline stored with its run (`speedup_paired`, with
its CI): the number `show`, `gate` and `ledger` print.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from orchestrate.api.config import ModelSpec
from orchestrate.api.protocol import Protocol, ProtocolError, split_phase
from orchestrate.research.decide import (
    NOT_MEANINGFUL,
    check_coverage,
    check_gates,
    decision_view,
    hardware_key,
    list_decisions,
    model_key,
    random_weights,
)
from orchestrate.research.holdout import list_audits
from orchestrate.research.noise import AA_SUFFIX
from orchestrate.research.scoring_run import load_rows, stack_quality
from orchestrate.running.metrics import AGGREGATE, HEADLINE, exactness, run_noise

if TYPE_CHECKING:
    from orchestrate.store.store import Store

Status = Literal["pass", "alert", "unverified"]
Gated = Literal["accepted", "retained", "not gated"]
GATED_LABEL = "holdout paired"  # what a gated step's speedup is
DEV_ONLY_LABEL = "dev only, not gated"


@dataclass
class Point:
    index: int
    run_id: str
    started_at: datetime
    phase: str
    stack: str
    spec_hash: str
    speedup: float
    exact: bool
    status: Status
    reasons: list[str]
    deltas: dict[str, float] = field(default_factory=dict)  # candidate - stock, if scored
    ci_low: float | None = None  # the headline's CI, as stored
    ci_high: float | None = None
    rtf_ratio: float | None = None  # the aggregate RTF ratio, shown beside it only
    exactness: str = "exact"  # metrics.exactness: exact, failed, unmeasured, approximate
    noisy: list[str] = field(default_factory=list)  # metrics.noise_reasons of its run
    gate: Gated = "not gated"  # the newest gate decision on its stack, in scope
    quality: str = "judged"  # or "not scored", or NOT_MEANINGFUL (random weights)


@dataclass
class Frontier:
    workload: str
    model: str | None
    hardware: str | None
    protocol: str
    points: list[Point]
    frontier: list[dict[str, Any]]  # where the best accepted (holdout paired) speedup rises
    pareto_metric: str
    pareto: list[dict[str, Any]]
    excluded: dict[str, int]
    dev_only: list[dict[str, Any]] = field(default_factory=list)  # never gated: apart

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _flagged_hashes(store: Store, workload: str) -> dict[str, list[str]]:
    """spec hash -> why the holdout audit flagged that stack."""
    why: dict[str, list[str]] = defaultdict(list)
    for a in list_audits(store, workload):
        if a["flagged"]:
            why[a["stack_hash"]].append("holdout reuse: " + "; ".join(a["flags"]))
    return why


def _decisions(
    store: Store, workload: str, digest: str, runs: set[str]
) -> dict[str, dict[str, Any]]:
    """spec hash -> the newest gate decision on it under this protocol, made on a run in
    scope (so on this model and hardware), with its view (decide.decision_view)."""
    latest: dict[str, dict[str, Any]] = {}
    for d in list_decisions(store, workload):  # oldest first: the newest stays
        if d["protocol_hash"] == digest and d["run_id"] in runs:
            latest[d["spec_hash"]] = d
    return {h: {**d, "view": decision_view(store, d)} for h, d in latest.items()}


def collect(
    store: Store,
    protocol: Protocol,
    workload: str,
    model: ModelSpec | None = None,
    hardware: str | None = None,
    pareto_metric: str | None = None,
    limit: int = 10_000,
) -> Frontier:
    digest = protocol.content_hash()
    flagged = _flagged_hashes(store, workload)
    excluded: dict[str, int] = defaultdict(int)
    points: list[Point] = []
    runs = []
    for run in sorted(store.list_runs(limit=limit), key=lambda r: (r["started_at"], r["id"])):
        base, phase = split_phase(run["workload_name"])
        if base != workload or phase == "noise":
            continue
        if run["status"] not in ("FINISHED", "PARTIAL"):
            excluded["run did not finish"] += 1
        elif run["protocol_hash"] != digest:  # never compared silently across versions
            excluded[f"protocol {run['protocol_hash']} (v{run['protocol_version']})"] += 1
        else:
            runs.append((run, phase))
    # Unless given, the newest run in scope fixes model and hardware: one plot, one machine.
    newest = store.get_result(runs[-1][0]["id"]) if runs else None
    wanted_model = model_key(model) if model else newest and model_key(newest.job.model)
    hardware = hardware or (newest and hardware_key(newest.environment))
    kept = []
    for run, phase in runs:
        result = store.get_result(run["id"])
        if model_key(result.job.model) != wanted_model:
            excluded[f"model {model_key(result.job.model)}"] += 1
            continue
        if (hw := hardware_key(result.environment)) != hardware:
            excluded[f"hardware {hw}"] += 1
            continue
        if result.results[0].stack.techniques:
            excluded["baseline is not stock"] += 1
            continue
        if not any(HEADLINE in sr.metrics for sr in result.results[1:]):
            excluded[f"no {HEADLINE} stored (no paired utterances, or an older record)"] += 1
            continue
        kept.append((run["id"], phase, result))
    decisions = _decisions(store, workload, digest, {run_id for run_id, _, _ in kept})
    for run_id, phase, result in kept:
        points += _points(store, run_id, phase, result, protocol, flagged, decisions, len(points))
    return _finish(
        workload,
        wanted_model,
        hardware,
        protocol,
        points,
        pareto_metric,
        dict(excluded),
        decisions,
    )


def _points(
    store: Store,
    run_id: str,
    phase: str,
    result: Any,
    protocol: Protocol,
    flagged: dict[str, list[str]],
    decisions: dict[str, dict[str, Any]],
    start: int,
) -> list[Point]:
    rows = load_rows(store, run_id)
    quality = stack_quality(result, rows, protocol) if rows else None
    random = random_weights(result.job.model)  # scores of random weights judge nothing
    judged = quality is not None and bool(protocol.quality.gates) and not random
    stock = result.results[0]
    noisy = run_noise([(sr.stack.name, sr.metrics) for sr in result.results])  # baseline too
    out = []
    for sr in result.results[1:]:
        speedup = sr.metrics.get(HEADLINE)  # the stored headline: no estimate of our own
        if sr.stack.name.endswith(AA_SUFFIX) or sr.status in ("failed", "refused") or not speedup:
            continue  # crashes live in the failure ledger, not on a speed plot
        spec_hash = sr.stack.content_hash()
        decision = decisions.get(spec_hash)
        gate: Gated = "not gated"
        if decision is not None:
            gate = "accepted" if decision["verdict"] == "accept" else "retained"
        reasons = list(flagged.get(spec_hash, []))
        if decision is not None and gate == "retained":  # never the best, whatever its speed
            reasons.append(f"retained by the gate: {decision['view']['why']}")
        reasons += [f"noisy run: {n}" for n in noisy]
        deltas: dict[str, float] = {}
        if quality is not None and not random:
            q_stock, q_cand = quality[stock.stack.name], quality[sr.stack.name]
            deltas = {
                m: q_cand.values[m] - q_stock.values[m]
                for m in q_cand.values
                if m in q_stock.values
            }
            checks = [*check_gates(q_stock, q_cand, protocol.quality)]
            checks.append(check_coverage(q_stock, q_cand, protocol.quality))
            reasons += [f"{c.metric}: {c.why}" for c in checks if not c.passed]
        fid = sr.fidelity
        exact = exactness(
            sr.exact, None if fid is None else fid.within_tolerance, len(sr.stack.techniques)
        )
        if exact == "failed":
            reasons.append("exact stack outside fidelity tolerance (exactness failed)")
        status: Status = "alert" if reasons else "pass"
        unscored = not judged
        if not reasons and not sr.exact and unscored:
            why = f"quality {NOT_MEANINGFUL}" if random else "quality not scored against gates"
            status, reasons = "unverified", [f"approximate; {why}"]
        if not reasons and exact == "unmeasured" and unscored:
            # the plugin's claim alone: no fidelity measured it, no scores either
            status, reasons = "unverified", ["declared exact, fidelity not measured; unscored"]
        out.append(
            Point(
                start + len(out),
                run_id,
                result.started_at,
                phase,
                sr.stack.name,
                spec_hash,
                speedup,
                sr.exact,
                status,
                reasons,
                deltas,
                ci_low=sr.metrics.get(f"{HEADLINE}_lo"),
                ci_high=sr.metrics.get(f"{HEADLINE}_hi"),
                rtf_ratio=sr.metrics.get(AGGREGATE),
                exactness=exact,
                noisy=noisy,
                gate=gate,
                quality=NOT_MEANINGFUL if random else "judged" if judged else "not scored",
            )
        )
    return out


def _finish(
    workload: str,
    model: str | None,
    hardware: str | None,
    protocol: Protocol,
    points: list[Point],
    pareto_metric: str | None,
    excluded: dict[str, int],
    decisions: dict[str, dict[str, Any]] | None = None,
) -> Frontier:
    at = {(p.run_id, p.spec_hash): p for p in points}
    accepted = sorted(
        (d for d in (decisions or {}).values() if d["verdict"] == "accept"),
        key=lambda d: (d["created_at"], d["id"]),
    )
    steps, best = [], 1.0  # stock is where every frontier starts
    for d in accepted:  # each at the run it was accepted on: the holdout's paired estimate
        p = at.get((d["run_id"], d["spec_hash"]))
        if p is not None and p.speedup > best:
            best = p.speedup
            view = d["view"]
            steps.append(
                _step(p, (view["headline"] or {}).get("label", GATED_LABEL))
                | {"overridden": view["overridden"], "quality": view["quality"]}
            )
    dev_only, best = [], 1.0
    for p in points:
        if p.gate == "not gated" and p.status == "pass" and p.speedup > best:
            best = p.speedup
            dev_only.append(_step(p, DEV_ONLY_LABEL))
    defs = protocol.quality.metrics
    if pareto_metric is not None and pareto_metric not in defs:
        raise ProtocolError(f"unknown metric {pareto_metric!r}; defined: {sorted(defs)}")
    metric = pareto_metric or next(
        (m for m in protocol.quality.noise_gated if any(m in p.deltas for p in points)),
        "wer" if "wer" in defs else next(iter(defs)),
    )
    lower = defs[metric].better == "lower"
    return Frontier(
        workload,
        model,
        hardware,
        f"{protocol.name} v{protocol.version} ({protocol.content_hash()})",
        points,
        steps,
        metric,
        pareto(points, metric, lower),
        excluded,
        dev_only,
    )


def _step(p: Point, label: str) -> dict[str, Any]:
    return {
        "index": p.index,
        "speedup": p.speedup,
        "ci_low": p.ci_low,
        "ci_high": p.ci_high,
        "stack": p.stack,
        "label": label,
    }


def pareto(points: list[Point], metric: str, lower_is_better: bool) -> list[dict[str, Any]]:
    """Stacks (latest scored point each, plus stock at 1x, Δ 0) that no other stack beats
    on both speedup and the quality delta of `metric`."""
    latest: dict[str, Point] = {}
    for p in points:
        if metric in p.deltas:
            latest[p.spec_hash] = p
    cands = [{"stack": "stock", "speedup": 1.0, "delta": 0.0, "status": "pass", "index": None}]
    cands += [
        {
            "stack": p.stack,
            "speedup": p.speedup,
            "delta": p.deltas[metric],
            "status": p.status,
            "index": p.index,
        }
        for p in latest.values()
    ]
    sign = 1.0 if lower_is_better else -1.0

    def dominated(a: dict[str, Any]) -> bool:
        return any(
            b is not a
            and b["speedup"] >= a["speedup"]
            and sign * b["delta"] <= sign * a["delta"]
            and (b["speedup"] > a["speedup"] or sign * b["delta"] < sign * a["delta"])
            for b in cands
        )

    return sorted((c for c in cands if not dominated(c)), key=lambda c: c["speedup"])
