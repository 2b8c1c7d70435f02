"""Orchestrator side of a run: job -> worker subprocess -> result -> store + MLflow.

The worker runs in its own process so a crash, an OOM kill or a `kill -9` cannot take the
orchestrator (and its bookkeeping) with it: whatever happens, the run row ends FINISHED,
PARTIAL, FAILED or INTERRUPTED, never RUNNING, and a result is written whole or not at all.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.api.records import JobSpec, ResultRecord, StackResult
from orchestrate.api.registry import job_identity
from orchestrate.running import metrics


class WorkerFailed(RuntimeError):
    pass


class Interrupted(RuntimeError):
    pass


@dataclass
class Outcome:
    run_id: str
    status: str
    result: ResultRecord | None
    comparisons: dict[str, dict[str, float]]
    result_path: Path | None
    mlflow_run_id: str | None = None
    error: str | None = None
    reused: bool = False


def comparisons(result: ResultRecord) -> dict[str, dict[str, float]]:
    """Each stack against the job's first stack (the baseline), from unrounded values, and
    against every other stack declared `baseline: true` (keys ending `_vs_NAME`)."""
    base = result.results[0]
    others = [r for r in result.results[1:] if r.stack.baseline and r.utterances]
    out: dict[str, dict[str, float]] = {}
    for r in result.results[1:]:
        if not (r.utterances and base.utterances):
            continue
        out[r.stack.name] = _against(base, r)
        for ref in (o for o in others if o is not r):
            for key, value in _against(ref, r).items():
                out[r.stack.name][f"{key.removesuffix('_vs_baseline')}_vs_{ref.stack.name}"] = value
    return out


def _against(base: StackResult, cand: StackResult) -> dict[str, float]:
    return metrics.compare(base.utterances, cand.utterances) | metrics.compare_s(
        base.metrics, cand.metrics
    )


def spawn_worker(
    job_path: Path, result_path: Path, log_path: Path, on_event: Callable[[dict[str, Any]], None]
) -> int:
    """Run the worker; its events go to `on_event` and, line by line, to events.jsonl
    beside the job, so a run killed half-way still shows how far it got."""
    worker = "orchestrate.running.worker"
    cmd = [sys.executable, "-m", worker, str(job_path), "--out", str(result_path)]
    events_path = job_path.with_name("events.jsonl")
    with log_path.open("w") as log, events_path.open("a", buffering=1) as events:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    log.write(line)  # stray prints from libraries
                    continue
                events.write(json.dumps({"t": time.time(), **event}) + "\n")
                on_event(event)
            return proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def describe_exit(rc: int, log_path: Path) -> str:
    tail = log_path.read_text()[-1500:].strip() if log_path.exists() else ""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        what = f"worker killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        what = f"worker exited with status {rc}"
    return f"{what}; last output:\n{tail}" if tail else what


def _raise_interrupt(signum: int, frame: object) -> None:
    raise Interrupted(f"orchestrator received {signal.Signals(signum).name}")


def execute(
    job: JobSpec,
    store: Any,
    runs_dir: Path,
    *,
    track: bool = True,
    force: bool = False,
    on_event: Callable[[dict[str, Any]], None] = lambda e: None,
) -> Outcome:
    ident = job_identity(job)
    if not force and (prev := store.find_run_by_identity(ident)):
        return Outcome(prev["id"], prev["status"], None, {}, None, reused=True)

    job_dir = runs_dir / job.job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    job = job.model_copy(update={"output_dir": str(job_dir.resolve())})
    job_path, result_path, log_path = (
        job_dir / "job.json",
        job_dir / "result.json",
        job_dir / "worker.log",
    )
    job.write(job_path)
    run_id = store.begin_run(job, ident)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        rc = spawn_worker(job_path, result_path, log_path, on_event)
        if not result_path.exists():
            raise WorkerFailed(describe_exit(rc, log_path))
        result = ResultRecord.read(result_path)
        comps = comparisons(result)
        mlflow_id = None
        if track:
            from orchestrate.store import tracking

            mlflow_id = tracking.log_run(result, run_id, comps, result_path, job_dir)
        store.finish_run(
            run_id, result, comps, result_path=str(result_path), mlflow_run_id=mlflow_id
        )
        if mlflow_id:
            store.set_mlflow_run_ids(run_id, mlflow_id, tracking.stack_run_ids(mlflow_id))
        return Outcome(run_id, result.status, result, comps, result_path, mlflow_id)
    except (KeyboardInterrupt, Interrupted) as exc:
        store.fail_run(run_id, "INTERRUPTED", str(exc) or "interrupted (Ctrl-C)")
        raise
    except WorkerFailed as exc:
        store.fail_run(run_id, "FAILED", str(exc))
        return Outcome(run_id, "FAILED", None, {}, None, error=str(exc))
    except Exception as exc:
        store.fail_run(run_id, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def ingest(result_path: Path, store: Any, *, track: bool = True) -> Outcome:
    """Record a result produced elsewhere (e.g. `orchestrate worker` on a GPU host)."""
    result = ResultRecord.read(result_path)
    comps = comparisons(result)
    run_id = store.ingest(result, comps, result_path=str(result_path))
    mlflow_id = None
    if track:
        from orchestrate.store import tracking

        mlflow_id = tracking.log_run(result, run_id, comps, result_path, result_path.parent)
        store.set_mlflow_run_ids(run_id, mlflow_id, tracking.stack_run_ids(mlflow_id))
    return Outcome(run_id, result.status, result, comps, result_path, mlflow_id)
