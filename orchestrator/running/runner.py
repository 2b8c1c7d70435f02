"""Orchestrator side of a run: job -> worker subprocess -> result -> store + MLflow.

The worker runs in its own process so a crash, an OOM kill or a `kill -9` cannot take the
orchestrator (and its bookkeeping) with it: whatever happens, the run row ends FINISHED,
PARTIAL, FAILED or INTERRUPTED, never RUNNING, and a result is written whole or not at all.
The database is written before MLflow, which is best effort: a measurement is never lost to
a tracking failure (`orchestrate sync-mlflow` logs it later). What a killed worker measured
is kept in its job folder (utterances.jsonl, WAVs); `plan_resume` turns it into a job that
continues the run (`orchestrate run --resume RUN`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.api.paths import inside
from orchestrate.api.records import JobSpec, ResultRecord, StackResult, UtteranceRecord
from orchestrate.api.registry import job_identity
from orchestrate.running import metrics
from orchestrate.running.mlflow_log import Comparisons, log_to_mlflow, one_line, probe_tracking
from orchestrate.store.errors import StoreError, StoreUnavailable
from orchestrate.store.queue import Claim, ClaimLost


class WorkerFailed(RuntimeError):
    pass


class WorkerLost(RuntimeError):
    """The process running the job went away with it while the orchestrator lives on (a
    Ray actor or its node died): the run is INTERRUPTED and the job goes back to the queue,
    its attempt recorded (store.requeue_claimed)."""


class Interrupted(RuntimeError):
    pass


class ResumeRefused(ValueError):
    """`--resume` would mix incompatible measurements, or finds nothing to resume; the
    message is one line saying why (the CLI exits 2 with it, before anything runs)."""


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
    against every other stack declared `baseline: true` (keys ending `_vs_NAME`); with the
    headline (metrics.headline, under the job's own protocol) and, for a stack declaring
    exact whose fidelity was measured, `exactness_failed` (1.0: outside tolerance)."""
    base = result.results[0]
    others = [r for r in result.results[1:] if r.stack.baseline and r.utterances]
    out: dict[str, dict[str, float]] = {}
    for r in result.results[1:]:
        if not (r.utterances and base.utterances):
            continue
        out[r.stack.name] = _against(base, r, result)
        for ref in (o for o in others if o is not r):
            for key, value in _against(ref, r, result).items():
                out[r.stack.name][f"{key.removesuffix('_vs_baseline')}_vs_{ref.stack.name}"] = value
    for r in result.results:
        if r.fidelity is None or not r.stack.techniques or not r.exact:
            continue  # nothing claimed, or nothing measured: no verdict to store
        verdict = metrics.exactness(r.exact, r.fidelity.within_tolerance)
        out.setdefault(r.stack.name, {})["exactness_failed"] = float(verdict == "failed")
    return out


def _against(base: StackResult, cand: StackResult, result: ResultRecord) -> dict[str, float]:
    protocol = result.job.protocol
    return (
        metrics.compare(base.utterances, cand.utterances)
        | metrics.compare_s(base.metrics, cand.metrics)
        | metrics.headline(base.utterances, cand.utterances, protocol.speed, protocol.speed_metric)
    )


# How a job reaches a worker: (job.json, result.json, worker.log, on_event) -> exit status.
WorkerLaunch = Callable[[Path, Path, Path, Callable[[dict[str, Any]], None]], int]


def spawn_worker(
    job_path: Path, result_path: Path, log_path: Path, on_event: Callable[[dict[str, Any]], None]
) -> int:
    """Run the worker; its events go to `on_event` and, line by line, to events.jsonl
    beside the job, so a run killed half-way still shows how far it got."""
    worker = "orchestrate.running.worker"
    cmd = [sys.executable, "-m", worker, str(job_path), "--out", str(result_path)]
    events_path = job_path.with_name("events.jsonl")
    with log_path.open("w") as log, events_path.open("a", buffering=1) as events:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=die_with_parent()
        )
        try:
            # Its pid, for describe_exit (did the kernel's OOM killer end it?) and tests.
            with suppress(OSError):
                job_path.with_name("worker.pid").write_text(f"{proc.pid}\n")
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


def stop_worker_in(job_dir: Path) -> bool:
    """SIGTERM the worker whose pid it wrote in `job_dir` (worker.pid); False when none."""
    try:
        pid = int((job_dir / "worker.pid").read_text().strip())
    except (OSError, ValueError):
        return False
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    return True


def die_with_parent() -> Callable[[], None] | None:
    """For the worker, run between fork and exec (Linux): SIGKILL it when the orchestrator
    dies, so a `kill -9` of `orchestrate run` leaves no orphan holding the GPU (what it
    measured is on disk already, in utterances.jsonl). prctl is looked up here, in the
    parent: the forked child only calls it (no imports or dlopen after a fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def describe_exit(rc: int, log_path: Path) -> str:
    """One line: how the worker ended, the error it raised (its last exception line, or
    an `error` event), and where its full log is. A signal is named as a fact; out of
    memory is said only when the kernel's log or the worker's own output says so."""
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    error = _error_event(log_path.with_name("events.jsonl")) or worker_error(log)
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        pid = log_path.with_name("worker.pid")
        what = f"worker killed by {name}" + _oom_evidence(f"{error}\n{log}", _read_pid(pid))
    else:
        what = f"worker exited with status {rc}"
    where = f"worker log: {log_path}"
    return f"{what}: {error} ({where})" if error else f"{what} ({where})"


_OOM = re.compile(r"out of memory|OutOfMemoryError|\bOOM\b", re.IGNORECASE)


def _oom_evidence(output: str, pid: int | None) -> str:
    """ " (out of memory ...)" when something says so, else "": a SIGKILL alone is also
    what `kill -9`, a scheduler or a container limit sends."""
    if pid is not None:
        with suppress(OSError, subprocess.SubprocessError):  # dmesg may be restricted
            kernel = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
            if re.search(rf"(Killed process {pid}\b|oom-kill:.*\bpid={pid}\b)", kernel):
                return " (out of memory: the kernel's OOM killer ended it)"
    return " (out of memory?)" if _OOM.search(output) else ""


def _read_pid(path: Path) -> int | None:
    """The worker's pid, as spawn_worker wrote it (worker.pid beside the job)."""
    with suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


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
    recordings_from: Path | None = None,
    worker: WorkerLaunch | None = None,
    claim: Claim | None = None,
) -> Outcome:
    """Run `job` in a worker and record it. `recordings_from`: a resumed job's old folder,
    whose WAVs of the carried utterances are linked (or copied) into the new one first.
    `worker`: a fresh process per job (spawn_worker, the default), or one kept warm
    (running.warm). `claim`: the queue's hold on the job (running.executor): its result is
    recorded with the job marked done, once, while the claim holds."""
    ident = job_identity(job)
    prev = None if force else store.find_run_by_identity(ident)
    # A noisy run is never served back as the measurement: this job measures afresh.
    if prev and not metrics.run_noise([(s["name"], s["metrics"]) for s in prev["stacks"]]):
        return Outcome(prev["id"], prev["status"], None, {}, None, reused=True)
    preflight(runs_dir, track)  # a bad folder or MLflow store costs one line, no measurement

    job_dir = runs_dir / job.job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    job = job.model_copy(update={"output_dir": str(job_dir.resolve())})
    if recordings_from is not None:  # before the run row: a failure here writes no row
        job = _carry_recordings(job, recordings_from, job_dir)
    job_path, result_path, log_path = (
        job_dir / "job.json",
        job_dir / "result.json",
        job_dir / "worker.log",
    )
    job.write(job_path)
    run_id = store.begin_run(job, ident)
    # SIGTERM interrupts the run (resumable); only the main thread may set it (a Ray pool
    # runs its members on threads, and its own main thread turns signals into a stop).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if main else None
    try:
        rc = (worker or spawn_worker)(job_path, result_path, log_path, on_event)
        if not result_path.exists():
            raise WorkerFailed(describe_exit(rc, log_path))
        result = ResultRecord.read(result_path)
        comps = comparisons(result)
        _record(store, run_id, result, comps, result_path, claim)  # the database first
        outcome = Outcome(run_id, result.status, result, comps, result_path)
        if track:  # MLflow second, best effort: its failure is a warning, the run stands
            outcome.mlflow_run_id, outcome.mlflow_warning = log_to_mlflow(
                store, run_id, result, comps, result_path
            )
        return outcome
    except (KeyboardInterrupt, Interrupted) as exc:
        store.fail_run(run_id, "INTERRUPTED", str(exc) or "interrupted (Ctrl-C)")
        raise
    except WorkerLost as exc:
        with suppress(Exception):
            store.fail_run(run_id, "INTERRUPTED", str(exc))
        raise
    except WorkerFailed as exc:
        error = str(exc) + _resume_hint(run_id, job_dir)
        store.fail_run(run_id, "FAILED", error)
        if claim is not None:
            store.finish_claimed(claim, run_id, None, error=error)
        return Outcome(run_id, "FAILED", None, {}, None, error=error)
    except ClaimLost as exc:  # cancelled or re-queued while it ran: not recorded
        with suppress(Exception):
            store.fail_run(run_id, "FAILED", f"not recorded: {exc}")
        raise
    except StoreError:
        raise  # _record marked the run (where the database let it) and names the recovery
    except Exception as exc:
        with suppress(Exception):  # the database may be what failed; keep the first error
            store.fail_run(run_id, "FAILED", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _resume_hint(run_id: str, job_dir: Path) -> str:
    """ "; N measured utterances kept: ..." when the worker recorded any before it ended."""
    journal = job_dir / "utterances.jsonl"
    lines = journal.read_text(errors="replace").splitlines() if journal.is_file() else []
    kept = sum(1 for line in lines if line.strip().endswith("}"))  # not a line cut short
    if not kept:
        return ""
    return f"; {kept} measured utterances kept: orchestrate run --resume {run_id[:12]} continues"


def _record(
    store: Any,
    run_id: str,
    result: ResultRecord,
    comps: Comparisons,
    result_path: Path,
    claim: Claim | None = None,
) -> None:
    """store.finish_run (or finish_claimed: the result and the queued job's end in one
    transaction); if the database refuses, one line saying the result is safe on disk and
    the command that records it (finish_run has marked the run FAILED)."""
    try:
        if claim is None:
            store.finish_run(run_id, result, comps, result_path=str(result_path))
        else:
            store.finish_claimed(claim, run_id, result, comps, result_path=str(result_path))
    except ClaimLost:
        raise
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


# ----------------------------------------------------------------------------- resume

RESUMABLE = ("INTERRUPTED", "FAILED")
JournalLines = list[tuple[str, str, UtteranceRecord]]  # (stack, device, record) per line


def plan_resume(store: Any, run_ref: str) -> tuple[JobSpec, Path]:
    """The job that continues run `run_ref`, and the run's job folder (where its WAVs are).

    The resumed run is a new run with a new run id and job id (a job is recorded once); its
    job is the old one plus `resumed_from` (the old run id) and `carried`: the utterances
    the old worker wrote to utterances.jsonl, which the new worker keeps (marked resumed)
    instead of timing them again. Warm-up and fidelity are redone. The old row stays as it
    was; `Store.get_run` of it names the new one (`resumed_by`). Raises ResumeRefused (one
    line) for a run that is not INTERRUPTED or FAILED, was resumed already, has no job
    folder, or whose measurements were taken with other code or on another device.
    """
    from orchestrate.running.worker import JOURNAL, read_journal

    run = store.get_run(run_ref, utterances=False)
    rid = run["id"][:12]
    if run["status"] not in RESUMABLE:
        raise ResumeRefused(
            f"cannot resume run {rid}: it is {run['status']}; only an INTERRUPTED or FAILED "
            "run can be resumed"
        )
    if later := store.resumed_by(run["id"]):
        again = later[-1]
        raise ResumeRefused(
            f"cannot resume run {rid}: it was resumed already as run {again['id'][:12]} "
            f"({again['status']})"
            + ("; resume that one instead" if again["status"] in RESUMABLE else "")
        )
    recorded = JobSpec.model_validate(run["job"])
    folder = Path(recorded.output_dir)
    journal = read_journal(folder / JOURNAL)
    if why := _incompatible(recorded, _job_on_disk(folder, rid), journal):
        raise ResumeRefused(f"cannot resume run {rid}: {why}")
    carried = {
        stack: [u.model_copy(update={"resumed": True}) for u in utts]
        for stack, utts in _carried(recorded, journal).items()
    }
    job = recorded.model_copy(
        update={
            "job_id": uuid.uuid4().hex[:12],
            "resumed_from": run["id"],
            "carried": carried,
            "output_dir": "",
        }
    )
    return job, folder


def _job_on_disk(folder: Path, rid: str) -> JobSpec:
    path = folder / "job.json"
    if not path.is_file():
        raise ResumeRefused(
            f"cannot resume run {rid}: its job folder {folder} is gone (no job.json there); "
            "run the experiment again"
        )
    try:
        return JobSpec.model_validate_json(path.read_text())
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ResumeRefused(
            f"cannot resume run {rid}: {path} is not a valid job ({one_line(exc)})"
        ) from exc


def _incompatible(recorded: JobSpec, on_disk: JobSpec, journal: JournalLines) -> str | None:
    """Why the utterances measured for the job cannot be mixed with new ones, or None."""
    import torch

    from orchestrate.api.registry import StackError, technique_code
    from orchestrate.running.environment import code_state
    from orchestrate.running.worker import device_name

    mixing = "; resuming would mix measurements of different code"
    code = code_state()
    try:
        techniques = technique_code(recorded.stacks)
    except StackError as exc:
        return f"{exc}{mixing}"
    for job in (recorded, on_disk):  # the database's copy and the folder's: both must agree
        for what, then, now in (
            ("code SHA", job.code_sha, code.sha),
            ("uncommitted changes", job.code_dirty, code.dirty),
            ("uncommitted-diff hash", job.code_diff_hash, code.diff_hash),
        ):
            if then != now:
                return f"it was measured with {what} {then} and this tree has {now}{mixing}"
        for name in sorted(job.technique_code.keys() | techniques.keys()):
            then_code, now_code = job.technique_code.get(name), techniques.get(name)
            if then_code != now_code:
                return (
                    f"technique {name} was {_code_label(then_code)} and is "
                    f"{_code_label(now_code)} now{mixing}"
                )
    if on_disk.model_dump() != recorded.model_dump():
        return f"{recorded.output_dir}/job.json is not the job recorded for it (edited?)"
    if recorded.model.device == "cuda" and not torch.cuda.is_available():
        return "it ran on CUDA and no CUDA device is visible here"
    here = device_name(recorded.model.device)
    if there := sorted({device for _, device, _ in journal} - {here}):
        return (
            f"its utterances were timed on {there[0]!r} and this device is {here!r}; "
            "resuming would mix measurements of different devices"
        )
    return None


def _code_label(code: dict[str, Any] | None) -> str:
    if code is None:
        return "absent"
    return f"version {code.get('version')} with source hash {code.get('source')}"


def _carried(job: JobSpec, journal: JournalLines) -> dict[str, list[UtteranceRecord]]:
    """Journal lines that belong to `job` (its stacks, prompts and seeds), each (stack,
    prompt, seed) once: the first line written for it."""
    stacks = {s.name for s in job.stacks}
    prompts, seeds = {p.id for p in job.workload.prompts}, set(job.workload.seeds)
    seen: set[tuple[str, str, int]] = set()
    out: dict[str, list[UtteranceRecord]] = {}
    for stack, _, utt in journal:
        key = (stack, utt.prompt_id, utt.seed)
        if stack in stacks and utt.prompt_id in prompts and utt.seed in seeds and key not in seen:
            seen.add(key)
            out.setdefault(stack, []).append(utt)
    return out


def _carry_recordings(job: JobSpec, old: Path, new: Path) -> JobSpec:
    """Link (or copy) the carried utterances' WAVs from the old job folder into the new
    one, so the resumed run's folder is whole; a WAV that is gone is dropped from its
    record (the worker then saves another)."""
    carried: dict[str, list[UtteranceRecord]] = {}
    for stack, utts in job.carried.items():
        carried[stack] = []
        for utt in utts:
            if utt.audio_path and inside(old, utt.audio_path).is_file():
                _link(old / utt.audio_path, inside(new, utt.audio_path))
            elif utt.audio_path:
                utt = utt.model_copy(update={"audio_path": None})
            carried[stack].append(utt)
    return job.model_copy(update={"carried": carried})


def _link(src: Path, dst: Path) -> None:
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)  # no second copy of the audio
        except OSError:  # another filesystem, or no hard links there
            shutil.copy2(src, dst)
    except OSError as exc:
        free = shutil.disk_usage(dst.parent if dst.parent.exists() else src.parent).free
        raise StoreUnavailable(
            f"cannot copy {src} into {dst.parent}: {exc.strerror or exc} ({free / 1e9:.2f} GB "
            "free); pass --runs-dir with a writable folder that has room"
        ) from exc
