"""The one way a job is run: an `Executor` takes planned jobs and hands back one recorded
`Outcome` per job, as each finishes. `run`, `gate`, `noise` and `explore` all use one.

Every job goes through the durable queue (store.queue) first, so `orchestrate queue` shows
it and its result is recorded once, by job id, with the job marked done in the same
transaction. Two executors:

    LocalExecutor   this process runs the jobs it queued, one at a time, in one worker
                    subprocess (kept warm between jobs, or a fresh one per job);
    PoolExecutor    a pool of workers (`orchestrate workers`, running.pool) runs them,
                    as many at once as it has workers that can; this process waits.

`executor_for` picks the pool when one is live on the database and can run the jobs.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from orchestrate.api.records import JobSpec
from orchestrate.api.registry import discover
from orchestrate.api.scheduling import (
    FINAL_STATES,
    Capabilities,
    Requirements,
    requirements_of,
    why_not,
)
from orchestrate.running import runner
from orchestrate.running.environment import hardware_key, local_hardware
from orchestrate.running.runner import (
    Interrupted,
    Outcome,
    WorkerLaunch,
    WorkerLost,
    comparisons,
)
from orchestrate.running.warm import WarmWorker
from orchestrate.store.queue import Claim, ClaimLost

Events = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Submission:
    """A job to run. `force`: measure it even when the identical experiment is recorded
    (fresh-seed remeasures always measure). `recordings_from`: for a job that resumes an
    interrupted run (runner.plan_resume), the old run's folder, whose WAVs it keeps.
    `priority`: higher runs first on a pool. `min_gpu_memory_gb`, `gpu_model`: what the
    worker must have beyond what the job's plan requires."""

    job: JobSpec
    force: bool = False
    recordings_from: Path | None = None
    priority: int = 0
    min_gpu_memory_gb: float | None = None
    gpu_model: str | None = None

    def requirements(self) -> Requirements:
        requires = {name: cls.requires for name, cls in discover().items()}
        return requirements_of(
            self.job, requires, min_gpu_memory_gb=self.min_gpu_memory_gb, gpu_model=self.gpu_model
        )

    def options(self) -> dict[str, Any]:
        folder = None if self.recordings_from is None else str(self.recordings_from)
        return {"force": self.force, "recordings_from": folder}


class Executor(Protocol):
    slots: int  # jobs it runs at once

    def run(self, jobs: list[Submission]) -> Iterator[tuple[int, Outcome]]:
        """Run `jobs`; yield (index into `jobs`, its recorded Outcome) as each finishes."""
        ...

    def close(self) -> None:
        """Release its workers (the caller stopped or was interrupted)."""
        ...


def submit(executor: Executor, jobs: list[Submission]) -> list[Outcome]:
    """Run `jobs` on `executor`; their outcomes in the order given."""
    outcomes: dict[int, Outcome] = dict(executor.run(jobs))
    return [outcomes[i] for i in range(len(jobs))]


# ----------------------------------------------------------------------------- local


class LocalExecutor:
    """Runs the jobs it queues here, one after another: in one worker kept warm between
    jobs (`warm`, the default) or a fresh worker subprocess per job."""

    slots = 1

    def __init__(
        self,
        store: Any,
        runs_dir: Path,
        *,
        track: bool,
        on_event: Events = lambda e: None,
        warm: bool = True,
        worker: WorkerLaunch | None = None,
    ) -> None:
        self.store, self.runs_dir, self.track, self.on_event = store, runs_dir, track, on_event
        self.worker = worker or (WarmWorker(runs_dir) if warm else None)
        self.id = f"{socket.gethostname()}:{os.getpid()}:local"

    def run(self, jobs: list[Submission]) -> Iterator[tuple[int, Outcome]]:
        for i, sub in enumerate(jobs):
            job_id = self.store.enqueue(
                sub.job,
                sub.requirements(),
                priority=sub.priority,
                options=sub.options(),
                max_attempts=1,  # nobody retries a job whose own process ended
            )
            caps = Capabilities.probe(sub.requirements().device, ())
            claim = self.store.claim_job(self.id, caps, job_id=job_id)
            assert claim is not None, f"job {job_id} was queued here and taken by another"
            yield (
                i,
                run_claimed(
                    self.store,
                    claim,
                    self.runs_dir,
                    self.worker,
                    track=self.track,
                    on_event=self.on_event,
                ),
            )

    def close(self) -> None:
        if isinstance(self.worker, WarmWorker):
            self.worker.close()


# ------------------------------------------------------------------------------ pool


@dataclass
class PoolExecutor:
    """Queues the jobs for a live pool (`orchestrate workers`) and waits for them."""

    store: Any
    on_event: Events = lambda e: None
    poll_s: float = 1.0
    slots: int = 1
    _queued: list[str] = field(default_factory=list)

    def run(self, jobs: list[Submission]) -> Iterator[tuple[int, Outcome]]:
        ids = []
        for sub in jobs:
            ids.append(
                self.store.enqueue(
                    sub.job, sub.requirements(), priority=sub.priority, options=sub.options()
                )
            )
            self._queued.append(ids[-1])
        waiting = dict(enumerate(ids))
        seen: dict[str, str | None] = {}
        while waiting:
            for i, job_id in list(waiting.items()):
                row = self.store.get_job(job_id)
                if row["progress"] != seen.get(job_id) and row["progress"]:
                    self.on_event({"event": "status", "message": row["progress"], "job": job_id})
                seen[job_id] = row["progress"]
                if row["state"] in FINAL_STATES:
                    del waiting[i]
                    yield i, outcome_of_job(self.store, row)
            if waiting:
                time.sleep(self.poll_s)

    def close(self) -> None:
        """Cancel what it queued that no worker has started (a caller interrupted)."""
        for job_id in self._queued:
            with suppress(Exception):
                if self.store.get_job(job_id)["state"] == "PENDING":
                    self.store.cancel_job(job_id)


def outcome_of_job(store: Any, row: dict[str, Any]) -> Outcome:
    """The Outcome of a finished queued job, from the store."""
    run_id = row["run_id"]
    if row["state"] != "DONE" or run_id is None:
        error = row["error"] or f"job {row['id']} {row['state'].lower()}"
        return Outcome(run_id or "", "FAILED", None, {}, None, error=error)
    result = store.get_result(run_id)
    run = store.get_run(run_id, utterances=False)
    path = Path(run["result_path"]) if run.get("result_path") else None
    reused = any("served_from_record" in h for h in row["history"])
    return Outcome(run_id, result.status, result, comparisons(result), path, reused=reused)


def live_pool_slots(store: Any, jobs: list[Submission]) -> int:
    """How many live pool workers could run every one of `jobs` (0: no pool for them)."""
    workers = [Capabilities.model_validate(w["capabilities"]) for w in store.live_workers()]
    reqs = [s.requirements() for s in jobs]
    return sum(1 for caps in workers if all(why_not(r, caps) is None for r in reqs))


def executor_for(
    store: Any,
    runs_dir: Path,
    jobs: list[Submission],
    *,
    track: bool,
    on_event: Events = lambda e: None,
    warm: bool = True,
) -> Executor:
    """A live pool that can run `jobs` if there is one, else this process."""
    store.reap_dead()
    slots = live_pool_slots(store, jobs)
    if slots:
        return PoolExecutor(store, on_event=on_event, slots=slots)
    return LocalExecutor(store, runs_dir, track=track, on_event=on_event, warm=warm)


def run_alone(
    job: JobSpec,
    store: Any,
    runs_dir: Path,
    *,
    track: bool,
    force: bool = False,
    on_event: Events = lambda e: None,
) -> Outcome:
    """One job on the executor `executor_for` picks (a live pool, else a fresh worker
    here): what the gate's and noise's jobs go through."""
    subs = [Submission(job, force=force)]
    executor = executor_for(store, runs_dir, subs, track=track, on_event=on_event, warm=False)
    try:
        (outcome,) = submit(executor, subs)
    finally:
        executor.close()
    return outcome


# --------------------------------------------------------------------- one claimed job


def run_claimed(
    store: Any,
    claim: Claim,
    runs_dir: Path,
    worker: WorkerLaunch | None,
    *,
    track: bool,
    on_event: Events = lambda e: None,
    beat_s: float = 5.0,
    release: bool = False,
) -> Outcome:
    """Measure a claimed job and record it with the claim; heart-beat while it runs (a
    cancelled job's worker is stopped). Interrupted, the job fails (`orchestrate run
    --resume` continues its run), or with `release` (a pool being stopped) goes back to the
    queue. A retry (attempt > 1) measures under a job id of its
    own: the killed attempt's run row stays, INTERRUPTED, and is never the one recorded."""
    job = claim.job
    if claim.attempt > 1:
        job = job.model_copy(update={"job_id": f"{claim.job_id}-r{claim.attempt}"})
    folder = claim.options.get("recordings_from")
    heart = _Heartbeat(store, claim, runs_dir / job.job_id, beat_s, worker)

    def events(event: dict[str, Any]) -> None:
        if event.get("event") in ("status", "stack", "utterance") and event.get("message"):
            heart.progress = str(event["message"])
        on_event(event)

    def measure(force: bool) -> Outcome:
        return runner.execute(  # by attribute: a test's stand-in for it is seen
            job,
            store,
            runs_dir,
            track=track,
            force=force,
            on_event=events,
            recordings_from=Path(folder) if folder else None,
            worker=worker,
            claim=claim,
        )

    with heart:
        try:
            outcome = measure(bool(claim.options.get("force")))
            if outcome.reused:
                outcome = _served(store, claim, outcome, measure)
        except ClaimLost:
            raise
        except WorkerLost as exc:  # its process died, not this one: another attempt
            with suppress(Exception):
                store.requeue_claimed(claim, str(exc))
            raise
        except (KeyboardInterrupt, Interrupted) as exc:
            with suppress(Exception):
                if release:
                    store.release_claim(claim, f"interrupted: {exc or 'Ctrl-C'}")
                else:
                    store.fail_claimed(claim, f"interrupted: {exc or 'Ctrl-C'}")
            raise
        except Exception as exc:
            with suppress(Exception):
                store.fail_claimed(claim, f"{type(exc).__name__}: {exc}")
            raise
    return outcome


def _served(
    store: Any, claim: Claim, outcome: Outcome, measure: Callable[[bool], Outcome]
) -> Outcome:
    """A recorded identical experiment answers the job, unless it was timed on other
    hardware (a job's identity names code and protocol, not the device): then measure."""
    result = store.get_result(outcome.run_id)
    if hardware_key(result.environment) != local_hardware(claim.job.model.device):
        return measure(True)
    store.finish_claimed(claim, outcome.run_id, None, reused=True)
    outcome.result, outcome.comparisons = result, comparisons(result)
    return outcome


class _Heartbeat:
    """A thread beating for a claimed job every `every_s`; when the store says the claim is
    gone (cancelled), it stops the job's worker process: by the pid the worker wrote in the
    job's folder, or through the launch's own `stop_job(job_dir)` where the worker runs
    elsewhere (a Ray actor's node)."""

    def __init__(
        self,
        store: Any,
        claim: Claim,
        job_dir: Path,
        every_s: float,
        worker: WorkerLaunch | None = None,
    ) -> None:
        self.store, self.claim, self.job_dir, self.every_s = store, claim, job_dir, every_s
        self.worker = worker
        self.progress: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="heartbeat")

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                held = self.store.beat(self.claim.worker_id, self.claim, self.progress)
            except Exception:
                continue
            if not held and not self._stop.is_set():  # set: the job ended meanwhile
                self._stop_worker()
                return

    def _stop_worker(self) -> None:
        if stop_job := getattr(self.worker, "stop_job", None):
            with suppress(Exception):  # a lost actor stops nothing more: its job is gone too
                stop_job(self.job_dir)
            return
        runner.stop_worker_in(self.job_dir)
