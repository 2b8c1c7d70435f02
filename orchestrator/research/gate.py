"""The phase gate: fresh remeasure on dev prompts, then (only if faster beyond noise) the
sealed holdout, scoring, and accept (new champion) or retain, with the evidence.

`run_gate` is the one sanctioned reader of holdout prompts (see orchestrator/research/holdout.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api import protocol as proto
from orchestrate.api.config import ModelSpec, StackSpec, Workload, load_stack
from orchestrate.api.protocol import Protocol
from orchestrate.api.registry import StackError, get_family
from orchestrate.running import metrics

if TYPE_CHECKING:
    from orchestrate.api.records import JobSpec
    from orchestrate.running.runner import Outcome


def _headline(stored: dict[str, float]) -> dict[str, float]:
    """The candidate's stored headline vs stock (and the aggregate beside it), for the
    report and the decision's evidence: what `ledger` shows beside the verdict."""
    keys = (metrics.HEADLINE, f"{metrics.HEADLINE}_lo", f"{metrics.HEADLINE}_hi")
    return {k: stored[k] for k in (*keys, metrics.AGGREGATE) if k in stored}


# What a stand-in remeasure may have otherwise: fresh seeds are the point of it; the name
# says its phase; every recording is kept either way; any warm-up count of at least one.
_MAY_DIFFER = {"name", "seeds", "save_audio", "warmups"}


def _not_a_remeasure(run: Outcome, planned: JobSpec, hardware: str) -> str | None:
    """Why `run` cannot be the gate's remeasure `planned` (None: it can). It must have
    measured every stack of `planned`, unchanged, after a warm-up, on its prompts, model,
    protocol, code and hardware: a result is never carried across any of these."""
    from orchestrate.research import decide

    if run.result is None:
        return "it has no result"
    job = run.result.job
    measured = {r.stack.name: r for r in run.result.results}
    for stack in planned.stacks:
        mine = measured.get(stack.name)
        if mine is None or mine.stack.content_hash() != stack.content_hash():
            return f"it did not measure {stack.name}"
        if mine.status == "failed":
            return f"{stack.name} failed in it"
    checks = {
        "model": job.model == planned.model,
        "protocol": job.protocol.content_hash() == planned.protocol.content_hash(),
        "workload": job.workload.model_dump(exclude=_MAY_DIFFER)
        == planned.workload.model_dump(exclude=_MAY_DIFFER),
        "warm-up": job.workload.warmups >= 1,
        "code": (job.code_sha, job.code_dirty, job.code_diff_hash)
        == (planned.code_sha, planned.code_dirty, planned.code_diff_hash)
        and all(job.technique_code.get(k) == v for k, v in planned.technique_code.items()),
        "hardware": decide.hardware_key(run.result.environment) == hardware,
    }
    differ = [what for what, same in checks.items() if not same]
    return f"its {', '.join(differ)} differ" if differ else None


def run_gate(
    store: Any,
    *,
    candidate: StackSpec,
    model: ModelSpec,
    dev: Workload,
    protocol: Protocol,
    runs_dir: Path,
    track: bool,
    allow_reuse: bool = False,
    holdout_file: Path | None = None,
    on_event: Any = None,
    submit: Callable[[JobSpec], Outcome] | None = None,
    remeasured: Outcome | None = None,
) -> dict[str, Any]:
    """Remeasure fresh on dev prompts; if faster beyond noise, open the sealed holdout (the
    only sanctioned reader), score it, and accept or retain. Returns the full evidence.
    `submit(job) -> Outcome` runs a job, always measured afresh (default: the executor, a
    live pool or a fresh worker here; an exploration passes its Submitter's). `remeasured`:
    a run that is already such a remeasure (an exploration's fresh-seed job of these stacks, after a
    warm-up, on this code, protocol, model and hardware): it stands in for the gate's own,
    which would measure the same thing again; anything less and the gate measures."""
    from orchestrate.research import decide, holdout, scoring_run
    from orchestrate.running.executor import run_alone
    from orchestrate.running.plan import plan_job

    proto.require_gates(protocol)
    store.register_protocol(protocol)
    on_event = on_event or (lambda e: None)
    submit = submit or (
        lambda job: run_alone(job, store, runs_dir, track=track, force=True, on_event=on_event)
    )
    stock = load_stack(get_family(model.family).baseline)  # the family names its baseline
    if not candidate.techniques or candidate.content_hash() == stock.content_hash():
        raise StackError("stock is the reference, not a candidate")
    hardware, mkey = decide.local_hardware(model.device), decide.model_key(model)
    champ = decide.current_champion(store, model.family, mkey, dev.name, hardware)
    champ_spec = decide.champion_spec(champ) if champ else None
    if champ_spec and champ_spec.content_hash() == candidate.content_hash():
        raise StackError(f"{candidate.name} is already the champion for {dev.name} here")
    stacks = [stock, *([champ_spec] if champ_spec else []), candidate]
    against = champ_spec.name if champ_spec else stock.name
    report: dict[str, Any] = {
        # The champion is re-measured in the same jobs, so its standing under an older
        # protocol version is never compared with numbers measured under this one.
        "champion": None
        if champ is None
        else {"stack": champ["stack_name"], "accepted_under": champ["protocol_hash"]},
        "candidate": candidate.name,
        "against": against,
        "hardware": hardware,
        "model": mkey,
        "workload": dev.name,
        "protocol": proto.label(protocol),
        "holdout_run": None,
    }
    keep = {"warmups": max(1, dev.warmups), "save_audio": len(dev.prompts) * len(dev.seeds)}
    remeasure = Workload.model_validate(
        dev.model_dump() | keep | {"name": proto.phase_workload(dev.name, "remeasure")}
    )
    planned = plan_job(model, remeasure, stacks, protocol, runs_dir)
    why_not = None if remeasured is None else _not_a_remeasure(remeasured, planned, hardware)
    if remeasured is not None and why_not is None:
        message = f"remeasure: fresh-seed run {remeasured.run_id[:12]} of the same stacks"
        on_event({"event": "status", "message": message})
        first, report["remeasure_from"] = remeasured, "the exploration"
    else:
        message = "fresh post-warm-up remeasure (dev prompts)"
        if remeasured is not None:
            message += f" (run {remeasured.run_id[:12]} cannot stand in: {why_not})"
        on_event({"event": "status", "message": message})
        first, report["remeasure_from"] = submit(planned), "this gate"
    report["remeasure_run"] = first.run_id
    if first.result is None:
        report["verdict"] = {"verdict": "retain", "failure": "crash", "reasons": [first.error]}
        return report
    by = {r.stack.name: r for r in first.result.results}
    # The headline vs stock as stored with the run (the one number every report shows).
    stored = first.comparisons.get(candidate.name, {})
    speedup = stored.get(metrics.HEADLINE, 0.0)
    report["headline"] = _headline(stored)
    noisy = report["noisy"] = metrics.result_noise(first.result, first.comparisons)
    checks = [
        decide.speed_check(
            "remeasure", by[against], by[candidate.name], protocol.speed, protocol.speed_metric
        )
    ]
    if against != stock.name:
        report["vs_stock"] = decide.speed_check(
            "remeasure", by[stock.name], by[candidate.name], protocol.speed, protocol.speed_metric
        ).reason()
    common = {
        "stack": candidate,
        "protocol": protocol,
        "family": model.family,
        "model": mkey,
        "workload": dev.name,
        "hardware": hardware,
        "speedup": speedup,
    }
    rw = report["random_weights"] = decide.random_weights(model)  # quality not judged
    early = decide.judge(by[candidate.name], checks, noisy=noisy, random_weights=rw)
    if early.verdict == "retain":  # broken, noisy or not faster: the holdout stays sealed
        evidence = {
            "remeasure_run": first.run_id,
            "holdout": "not opened",
            "headline": report["headline"],
        }
        report["record"] = decide.record(
            store, run_id=first.run_id, verdict=early, evidence=evidence, **common
        )
        report["verdict"] = early.to_dict()
        return report
    sealed_file = holdout_file or holdout.holdout_path(dev.name)
    with holdout.unseal("gate") as key:
        held, held_hash = holdout.load_holdout(dev, key, sealed_file)
        opened = holdout.open_audit(
            store, key, dev.name, held_hash, candidate, protocol.content_hash()
        )
        report["holdout_flags"] = opened.flags
        status, run_id = "error", None
        try:
            on_event({"event": "status", "message": "holdout gate (sealed prompts)"})
            # placeholders for texts: the worker reads them from the sealed file
            second = submit(
                plan_job(model, held, stacks, protocol, runs_dir, sealed_file=sealed_file)
            )
            run_id = report["holdout_run"] = second.run_id
            if second.result is None:
                report["verdict"] = {
                    "verdict": "retain",
                    "failure": "crash",
                    "reasons": [second.error],
                }
                return report
            on_event({"event": "status", "message": "scoring holdout recordings"})
            scoring_run.score_run(store, second.run_id, protocol)
            rows = scoring_run.load_rows(store, second.run_id)
            quality = scoring_run.stack_quality(second.result, rows, protocol)
            held_by = {r.stack.name: r for r in second.result.results}
            checks.append(
                decide.speed_check(
                    "holdout",
                    held_by[against],
                    held_by[candidate.name],
                    protocol.speed,
                    protocol.speed_metric,
                    judge_on="point",
                    threshold=1.0,
                )
            )
            q_stock, q_cand = quality[stock.name], quality[candidate.name]
            gates = decide.check_gates(q_stock, q_cand, protocol.quality)
            gates.append(decide.check_coverage(q_stock, q_cand, protocol.quality))
            report["holdout_noisy"] = metrics.result_noise(second.result, second.comparisons)
            verdict = decide.judge(
                held_by[candidate.name],
                checks,
                gates,
                opened.flags,
                allow_flagged=allow_reuse,
                noisy=[f"holdout {n}" for n in report["holdout_noisy"]],
                random_weights=rw,
            )
            stack_runs = {s["name"]: s["mlflow_run_id"] for s in store.get_run(run_id)["stacks"]}
            evidence = {
                "remeasure_run": first.run_id,
                "holdout_run": run_id,
                "holdout_hash": held_hash,
                "headline": report["headline"],
            }
            report["record"] = decide.record(
                store,
                run_id=run_id,
                verdict=verdict,
                evidence=evidence,
                mlflow_stack_run=stack_runs.get(candidate.name) if track else None,
                **common,
            )
            report["quality"] = {k: vars(v) for k, v in quality.items()}
            report["verdict"] = verdict.to_dict()
            status = verdict.verdict
        finally:
            detail = {"verdict": report.get("verdict", {}).get("verdict", "error")}
            holdout.close_audit(store, opened.audit_id, status, run_id, detail)  # type: ignore[arg-type]
    return report
