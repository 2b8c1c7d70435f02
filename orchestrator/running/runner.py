"""Orchestrator side of a run: job -> worker subprocess -> result -> store + MLflow.

The worker runs in its own process so a crash, an OOM kill or a `kill -9` cannot take the
orchestrator (and its bookkeeping) with it: whatever happens, the run row ends FINISHED,
PARTIAL, FAILED or INTERRUPTED, never RUNNING, and a result is written whole or not at all.
The database is written before MLflow, which is best effort: a measurement is never lost to
a tracking failure (`orchestrate sync-mlflow` logs it later).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.api.records import JobSpec, ResultRecord, StackResult
from orchestrate.api.registry import job_identity
from orchestrate.running import metrics
from orchestrate.running.mlflow_log import Comparisons, log_to_mlflow, one_line, probe_tracking
from orchestrate.store.errors import StoreError, StoreUnavailable


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
    mlflow_warning: str | None = None  # MLflow logging failed; the database holds the run


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
    """One line: how the worker ended, the error it raised (its last exception line, or
    an `error` event), and where its full log is."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        what = f"worker killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    else:
        what = f"worker exited with status {rc}"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    error = _error_event(log_path.with_name("events.jsonl")) or worker_error(log)
    where = f"worker log: {log_path}"
    return f"{what}: {error} ({where})" if error else f"{what} ({where})"


def worker_error(log: str) -> str | None:
    """The exception line of the last traceback in a worker log, else its last line that
    is not a warning (libraries warn on stderr, also after a traceback, at exit)."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            if line.strip() and not line[0].isspace():  # frames and source lines are indented
                return _QUALIFIED.sub("", line.strip())  # WeightsError, not a.b.c.WeightsError
    for line in reversed(lines):
        if line.strip() and not line[0].isspace() and not _WARNING.search(line):
            return line.strip()
    return None


_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")
_WARNING = re.compile(r"\w*Warning\b|^warnings\.warn|^\s*warn\(")


def _error_event(events: Path) -> str | None:
    """The message of the worker's last {"event": "error"} line, if it wrote one."""
    if not events.exists():
        return None
    found = None
    for line in events.read_text(errors="replace").splitlines():
        with suppress(json.JSONDecodeError, AttributeError):
            event = json.loads(line)
            if event.get("event") == "error":
                found = str(event.get("message") or event.get("error") or "").strip() or None
    return found.splitlines()[0] if found else None


def preflight(runs_dir: Path, track: bool) -> None:
    """Before a worker starts: the runs folder must take a file and, when tracking, the
    MLflow store must open. Raises StoreUnavailable (one line) otherwise."""
    from orchestrate.store import probes

    probes.check_folder(runs_dir, "runs folder", "pass --runs-dir with a writable folder")
    if track:
        probe_tracking()


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
    preflight(runs_dir, track)  # a bad folder or MLflow store costs one line, no measurement

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
        _record(store, run_id, result, comps, result_path)  # the database first: it decides
        outcome = Outcome(run_id, result.status, result, comps, result_path)
        if track:  # MLflow second, best effort: its failure is a warning, the run stands
            outcome.mlflow_run_id, outcome.mlflow_warning = log_to_mlflow(
                store, run_id, result, comps, result_path
            )
        return outcome
    except (KeyboardInterrupt, Interrupted) as exc:
        store.fail_run(run_id, "INTERRUPTED", str(exc) or "interrupted (Ctrl-C)")
        raise
    except WorkerFailed as exc:
        store.fail_run(run_id, "FAILED", str(exc))
        return Outcome(run_id, "FAILED", None, {}, None, error=str(exc))
    except StoreError:
        raise  # _record marked the run (where the database let it) and names the recovery
    except Exception as exc:
        with suppress(Exception):  # the database may be what failed; keep the first error
            store.fail_run(run_id, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _record(
    store: Any, run_id: str, result: ResultRecord, comps: Comparisons, result_path: Path
) -> None:
    """store.finish_run; if the database refuses, one line saying the result is safe on
    disk and the command that records it (finish_run has marked the run FAILED)."""
    try:
        store.finish_run(run_id, result, comps, result_path=str(result_path))
    except Exception as exc:
        raise StoreUnavailable(
            f"recording run {run_id} failed ({one_line(exc)}); the measurement is safe in "
            f"{result_path}: orchestrate ingest {result_path}"
        ) from exc


def ingest(result_path: Path, store: Any, *, track: bool = True) -> Outcome:
    """Record a result produced elsewhere (e.g. `orchestrate worker` on a GPU host); the
    database first, then MLflow, best effort."""
    result = ResultRecord.read(result_path)
    comps = comparisons(result)
    run_id = store.ingest(result, comps, result_path=str(result_path))
    outcome = Outcome(run_id, result.status, result, comps, result_path)
    if track:
        outcome.mlflow_run_id, outcome.mlflow_warning = log_to_mlflow(
            store, run_id, result, comps, result_path
        )
    return outcome
