"""Rows <-> records: how a ResultRecord is written to the store's tables and read back.

Kept apart from store.py (sessions, run lifecycle, queries) so the mapping of each record
field to its column reads in one place; a round trip must give back the record exactly.
"""

from __future__ import annotations

import json
import math
import re
import signal
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from orchestrate.api.config import StackSpec
from orchestrate.api.records import (
    EnvironmentInfo,
    FidelityRecord,
    JobSpec,
    ResultRecord,
    StackResult,
    UtteranceRecord,
    utcnow,
)
from orchestrate.db.models import Failure, Metric, Run, Stack, StackResultRow, Utterance, columns

RESULT_STATUS = {"finished": "FINISHED", "partial": "PARTIAL", "failed": "FAILED"}
Comparisons = dict[str, dict[str, float]]


# Out of memory only as a fact: CUDA's own error (torch.OutOfMemoryError, "CUDA out of
# memory") or the kernel's OOM killer as runner.describe_exit names it. Its "(out of
# memory?)" is a guess from a log line, and a bare SIGKILL is also what `kill -9`, a
# scheduler or a container limit sends.
_OOM_FACT = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|the kernel's OOM killer"
)
_KILLED = re.compile(r"killed by (?:signal (\d+)|(SIG[A-Z0-9]+))")


def failure_cause(error: str | None) -> str:
    """What a failure message says, as a fact: `oom`, `killed (signal N)`, `compile`,
    `crash`, or `other` (no message)."""
    text = error or ""
    if _OOM_FACT.search(text):
        return "oom"
    if killed := _KILLED.search(text):
        number, name = killed.groups()
        if name in signal.Signals.__members__:
            number = str(signal.Signals[name].value)
        return f"killed (signal {number or name})"
    if any(w in text.lower() for w in ("compile", "inductor", "dynamo", "triton")):
        return "compile"
    return "crash" if text else "other"


def classify_failure(error: str | None) -> str:
    """A failures-ledger cause for an error message, as stored: failures.cause is a closed
    set (db.models.FAILURE_CAUSES), so a kill is stored as `crash` and the ledger names
    the signal from the detail (failure_cause)."""
    cause = failure_cause(error)
    return "crash" if cause.startswith("killed") else cause


def failure_row(run_id: str | None, stack_name: str | None, cause: str, detail: str) -> Failure:
    return Failure(
        created_at=utcnow(), run_id=run_id, stack_name=stack_name, cause=cause, detail=detail
    )


def write_result(
    s: Session,
    run: Run,
    result: ResultRecord,
    comparisons: Comparisons | None,
    result_path: str | None,
    mlflow_run_id: str | None,
) -> None:
    comparisons = comparisons or {}
    names = [sr.stack.name for sr in result.results]
    unknown = sorted(set(comparisons) - set(names))
    if unknown:
        raise ValueError(f"comparisons for stacks not in the result: {unknown}")
    run.status = RESULT_STATUS[result.status]
    run.started_at, run.ended_at = result.started_at, result.finished_at
    run.environment_json = result.environment.model_dump_json()
    run.error = result.error
    run.result_path = result_path if result_path is not None else run.result_path
    run.mlflow_run_id = mlflow_run_id if mlflow_run_id is not None else run.mlflow_run_id
    for position, sr in enumerate(result.results):
        row = StackResultRow(
            run_id=run.id,
            stack_id=stack_id(s, sr.stack),
            position=position,
            status=sr.status,
            exact=sr.exact,
            applied_json=json.dumps(sr.applied),
            skipped_json=json.dumps(sr.skipped),
            error=sr.error,
            setup_s=sr.setup_s,
            warmup_s=sr.warmup_s,
            peak_memory_bytes=sr.peak_memory_bytes,
            fidelity_json=sr.fidelity.model_dump_json() if sr.fidelity else None,
        )
        row.utterances = [  # `resumed` is read back from the run's job (runs._mark_resumed)
            Utterance(position=i, **u.model_dump(exclude={"resumed"}))
            for i, u in enumerate(sr.utterances)
        ]
        row.metrics = [
            Metric(key=k, value=v)
            for k, v in merged_metrics(sr.stack.name, sr.metrics, comparisons).items()
        ]
        s.add(row)
        if sr.status in ("failed", "refused"):
            cause = "refused" if sr.status == "refused" else classify_failure(sr.error)
            detail = sr.error or (json.dumps(sr.skipped) if sr.skipped else sr.status)
            s.add(failure_row(run.id, sr.stack.name, cause, detail))
    if result.status == "failed" and result.error:
        s.add(failure_row(run.id, None, classify_failure(result.error), result.error))
    s.flush()  # surface constraint errors here, inside the transaction


def merged_metrics(
    stack: str, metrics: dict[str, float], comparisons: Comparisons
) -> dict[str, float]:
    extra = comparisons.get(stack, {})
    clash = sorted(set(metrics) & set(extra))
    if clash:
        raise ValueError(f"stack {stack}: comparison metrics {clash} clash with worker metrics")
    merged = {**metrics, **extra}
    bad = {k: v for k, v in merged.items() if not math.isfinite(v)}
    if bad:
        # NaN would silently become NULL in SQLite and null in JSON: refuse it loudly.
        raise ValueError(f"stack {stack}: non-finite metric values {bad}")
    return merged


def stack_id(s: Session, spec: StackSpec) -> int:
    spec_hash = spec.content_hash()
    found = s.scalar(select(Stack.id).where(Stack.spec_hash == spec_hash))
    if found is not None:
        return found
    row = Stack(
        name=spec.name, family=spec.family, spec_hash=spec_hash, spec_json=spec.model_dump_json()
    )
    try:
        with s.begin_nested():  # another writer may insert the same stack concurrently
            s.add(row)
    except IntegrityError:
        return s.scalars(select(Stack.id).where(Stack.spec_hash == spec_hash)).one()
    return row.id


def run_fields(run: Run) -> dict[str, Any]:
    return {k: v for k, v in columns(run).items() if not k.endswith("_json")}


def maybe_json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def stack_fields(sr: StackResultRow, utterances: bool) -> dict[str, Any]:
    spec = json.loads(sr.stack.spec_json)
    fields = {
        "name": spec["name"],
        "position": sr.position,
        "spec": spec,
        "spec_hash": sr.stack.spec_hash,
        "status": sr.status,
        "exact": sr.exact,
        "applied": json.loads(sr.applied_json),
        "skipped": json.loads(sr.skipped_json),
        "error": sr.error,
        "setup_s": sr.setup_s,
        "warmup_s": sr.warmup_s,
        "peak_memory_bytes": sr.peak_memory_bytes,
        "fidelity": maybe_json(sr.fidelity_json),
        "metrics": {m.key: m.value for m in sorted(sr.metrics, key=lambda m: m.key)},
        "mlflow_run_id": sr.mlflow_run_id,
    }
    if utterances:
        keep = UtteranceRecord.model_fields
        fields["utterances"] = [
            {k: v for k, v in columns(u).items() if k in keep} for u in sr.utterances
        ]
    return fields


def stack_result(st: dict[str, Any]) -> StackResult:
    return StackResult(
        stack=StackSpec.model_validate(st["spec"]),
        status=st["status"],
        applied=st["applied"],
        skipped=st["skipped"],
        exact=st["exact"],
        error=st["error"],
        setup_s=st["setup_s"],
        warmup_s=st["warmup_s"],
        peak_memory_bytes=st["peak_memory_bytes"],
        utterances=[UtteranceRecord.model_validate(u) for u in st["utterances"]],
        fidelity=None if st["fidelity"] is None else FidelityRecord.model_validate(st["fidelity"]),
        metrics=st["metrics"],
    )


def result_record(run: dict[str, Any]) -> ResultRecord:
    """The worker's ResultRecord again, from a `Store.get_run` row (or its JSON)."""
    return ResultRecord(
        job=JobSpec.model_validate(run["job"]),
        status={v: k for k, v in RESULT_STATUS.items()}[run["status"]],
        started_at=run["started_at"],
        finished_at=run["ended_at"],
        environment=EnvironmentInfo.model_validate(run["environment"]),
        results=[stack_result(st) for st in run["stacks"]],
        error=run["error"],
    )


def model_label(model: dict[str, Any]) -> str:
    """Short model description for listings: preset, device, dtype, and whose weights."""
    weights = "random" if model.get("weights") is None else "weights"
    return f"{model['preset']} {model['device']} {model['dtype']} {weights}"
