"""The durable job queue and the pool workers that drain it.

A job is enqueued PENDING; a worker claims it (RUNNING, `attempts` + 1) in one write
transaction that also checks the job's requirements against the worker's capabilities, so
two workers never hold one job: SQLite serialises writers (BEGIN IMMEDIATE), and on a
server database the select locks the row it takes and skips rows others hold (FOR UPDATE
SKIP LOCKED). The worker's result is recorded by `finish_claimed`, which writes the run's
result and marks the job DONE in one transaction, and only while the worker still holds
its claim: a job re-queued from under a worker thought dead is not recorded twice.

A worker that dies stops heart-beating; `reap_dead` gives its job back (or fails it after
`max_attempts` claims, listing them). On this host a dead worker is seen at once (its pid
is gone); elsewhere, by a heartbeat older than `stale_s`.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from orchestrate.api.records import JobSpec, ResultRecord, utcnow
from orchestrate.api.scheduling import FINAL_STATES, Capabilities, Requirements, why_not
from orchestrate.db.models import PoolWorker, QueuedJob, Run
from orchestrate.store.errors import RunNotFound, StoreError
from orchestrate.store.pids import owner_alive
from orchestrate.store.rows import Comparisons, write_result
from orchestrate.store.sessions import Sessions

# A worker silent this long is taken for dead (another host's, whose pid we cannot see).
DEFAULT_STALE_S = 120.0


class JobNotFound(StoreError, LookupError):
    pass


class ClaimLost(StoreError):
    """The worker no longer holds the job it is recording (re-queued or cancelled)."""


class PoolRefused(StoreError):
    """Another pool already drains this database."""


@dataclass(frozen=True)
class Claim:
    """A worker's hold on a job: what `finish_claimed` checks before recording."""

    job_id: str
    worker_id: str
    attempt: int
    job: JobSpec
    options: dict[str, Any]


class QueueMixin(Sessions):
    """Queued jobs (`jobs`) and live pool workers (`pool_workers`)."""

    # ----------------------------------------------------------------------- jobs

    def enqueue(
        self,
        job: JobSpec,
        requirements: Requirements,
        *,
        priority: int = 0,
        options: dict[str, Any] | None = None,
        max_attempts: int = 3,
    ) -> str:
        """Queue a planned job; returns its id (the job's own)."""
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        stacks = ", ".join(s.name for s in job.stacks)
        label = f"{job.model.preset} {job.workload.name}: {stacks}"
        with self._write() as s:
            if s.get(QueuedJob, job.job_id) is not None:
                raise StoreError(f"job {job.job_id} is already queued")
            s.add(
                QueuedJob(
                    id=job.job_id,
                    state="PENDING",
                    priority=priority,
                    submitted_at=utcnow(),
                    submitted_by=f"{socket.gethostname()}:{os.getpid()}",
                    label=label,
                    schema_version=job.schema_version,
                    job_json=job.model_dump_json(),
                    requirements_json=requirements.model_dump_json(),
                    options_json=json.dumps(options or {}),
                    attempts=0,
                    max_attempts=max_attempts,
                    history_json="[]",
                )
            )
        return job.job_id

    def claim_job(
        self, worker_id: str, caps: Capabilities, *, job_id: str | None = None
    ) -> Claim | None:
        """Take the first pending job (highest priority, then oldest) this worker can run;
        None when there is none. `job_id`: that job only, whatever it requires (the process
        that planned it for its own device runs it)."""
        query = select(QueuedJob).where(QueuedJob.state == "PENDING")
        if job_id is not None:
            query = query.where(QueuedJob.id == job_id)
        query = query.order_by(QueuedJob.priority.desc(), QueuedJob.submitted_at, QueuedJob.id)
        with self._write() as s:
            for row in s.scalars(query.with_for_update(skip_locked=True)):
                req = Requirements.model_validate_json(row.requirements_json)
                if job_id is None and why_not(req, caps):
                    continue
                now = utcnow()
                row.state, row.worker_id, row.device = "RUNNING", worker_id, caps.label()
                row.attempts += 1
                row.claimed_at = row.heartbeat_at = now
                row.progress = None
                _history(row, {"attempt": row.attempts, "worker": worker_id, "at": now})
                worker = s.get(PoolWorker, worker_id)
                if worker is not None:
                    worker.job_id = row.id
                return Claim(
                    row.id,
                    worker_id,
                    row.attempts,
                    JobSpec.model_validate_json(row.job_json),
                    json.loads(row.options_json),
                )
        return None

    def finish_claimed(
        self,
        claim: Claim,
        run_id: str,
        result: ResultRecord | None,
        comparisons: Comparisons | None = None,
        result_path: str | None = None,
        *,
        error: str | None = None,
        reused: bool = False,
    ) -> None:
        """Record the claimed job's outcome: with `result`, the run's result and the job
        DONE in one transaction; without (the run failed or was served from an identical
        recorded one), the job DONE or FAILED (`error`) pointing at `run_id`. Raises
        ClaimLost, writing nothing, when the worker no longer holds the job."""
        with self._write() as s:
            row = _held(s, claim)
            if result is not None:
                run = s.get(Run, run_id)
                if run is None:
                    raise RunNotFound(f"no run {run_id!r}")
                write_result(s, run, result, comparisons, result_path, None)
            if reused:
                _history(row, {"served_from_record": run_id, "at": utcnow()})
            _end(row, "FAILED" if error else "DONE", run_id=run_id, error=error)

    def release_claim(self, claim: Claim, why: str) -> None:
        """Give a claimed job back (the worker is stopping before it started the job)."""
        with self._write() as s:
            row = _held(s, claim)
            row.state, row.worker_id, row.attempts = "PENDING", None, row.attempts - 1
            _history(row, {"released": why, "at": utcnow()})

    def requeue_claimed(self, claim: Claim, why: str) -> str:
        """The claimed job's worker died with it while its claimer lives (a Ray actor):
        the attempt is recorded and the job goes back to the queue, or FAILED past
        `max_attempts`. Returns the job's new state ("" when the claim was already lost)."""
        with self._write() as s:
            row = s.get(QueuedJob, claim.job_id)
            if row is None or row.state != "RUNNING" or row.worker_id != claim.worker_id:
                return ""
            _give_back(row, why)
            worker = s.get(PoolWorker, claim.worker_id)
            if worker is not None:
                worker.job_id = None
            return row.state

    def fail_claimed(self, claim: Claim, error: str, run_id: str | None = None) -> None:
        """The claimed job failed where no run could say so (it did not plan, the worker
        process could not start): FAILED with `error`. A lost claim is left alone."""
        with self._write() as s:
            row = s.get(QueuedJob, claim.job_id)
            if row is None or row.state != "RUNNING" or row.worker_id != claim.worker_id:
                return
            _end(row, "FAILED", run_id=run_id, error=error)

    def cancel_job(self, job_ref: str) -> dict[str, Any]:
        """Cancel a pending job (a running one is cancelled when its worker next beats);
        returns the job as it was. A finished job is left as it is (`state` says which)."""
        with self._write() as s:
            row = s.get_one(QueuedJob, self.resolve_job(job_ref))
            before = _job_fields(row)
            if row.state == "PENDING":
                _end(row, "CANCELLED", error="cancelled before it started")
            elif row.state == "RUNNING":
                _end(row, "CANCELLED", error=f"cancelled while running on {row.worker_id}")
            return before

    def resolve_job(self, job_ref: str) -> str:
        with self._read() as s:
            ids = list(s.scalars(select(QueuedJob.id).where(QueuedJob.id.startswith(job_ref))))
        if not ids:
            raise JobNotFound(f"no queued job {job_ref!r} (orchestrate queue lists them)")
        if len(ids) > 1 and job_ref not in ids:
            raise JobNotFound(f"job prefix {job_ref!r} is ambiguous: {', '.join(sorted(ids))}")
        return job_ref if job_ref in ids else ids[0]

    def get_job(self, job_ref: str) -> dict[str, Any]:
        with self._read() as s:
            return _job_fields(s.get_one(QueuedJob, self.resolve_job(job_ref)))

    def list_jobs(self, states: tuple[str, ...] | None = None, limit: int = 50) -> list[dict]:
        """Newest first (pending and running before finished ones when no state is asked)."""
        query = select(QueuedJob).order_by(QueuedJob.submitted_at.desc(), QueuedJob.id)
        if states:
            query = query.where(QueuedJob.state.in_(states))
        with self._read() as s:
            rows = [_job_fields(r) for r in s.scalars(query.limit(limit))]
        return sorted(rows, key=lambda r: r["state"] in FINAL_STATES)

    def jobs_left(self, caps: Capabilities) -> int:
        """Jobs a worker with `caps` might still run: pending ones it can run, and running
        ones (their worker may die and give them back)."""
        with self._read() as s:
            rows = s.execute(
                select(QueuedJob.state, QueuedJob.requirements_json).where(
                    QueuedJob.state.in_(("PENDING", "RUNNING"))
                )
            ).all()
        return sum(
            1
            for state, req in rows
            if state == "RUNNING" or why_not(Requirements.model_validate_json(req), caps) is None
        )

    # -------------------------------------------------------------------- workers

    def register_worker(
        self, worker_id: str, pool_id: str, slot: str, caps: Capabilities, *, lock: bool = False
    ) -> None:
        """Add a live worker. `lock`: the pool's own row; refused (PoolRefused) while a
        worker of another live pool uses this database (one host drains one database; more
        hosts go through a distributed engine)."""
        now = utcnow()
        with self._write() as s:
            if lock:
                self._drop_dead_workers(s, DEFAULT_STALE_S)
                others = s.scalars(select(PoolWorker).where(PoolWorker.pool_id != pool_id)).all()
                if others:
                    w = others[0]
                    raise PoolRefused(
                        f"a worker pool already drains this database: {w.slot} worker pid "
                        f"{w.pid} on {w.host}, started {w.started_at:%Y-%m-%d %H:%M:%S} UTC; "
                        "one pool per database (stop it first; more hosts need a distributed "
                        "engine)"
                    )
            s.merge(
                PoolWorker(
                    id=worker_id,
                    pool_id=pool_id,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                    slot=slot,
                    capabilities_json=caps.model_dump_json(),
                    started_at=now,
                    heartbeat_at=now,
                    job_id=None,
                )
            )

    def unregister_worker(self, worker_id: str) -> None:
        with self._write() as s:
            s.execute(delete(PoolWorker).where(PoolWorker.id == worker_id))

    def beat(self, worker_id: str, claim: Claim | None = None, progress: str | None = None) -> bool:
        """The worker is alive (and so is its claim). False when its claimed job was
        cancelled or taken from it: the worker stops that job. A job already recorded is
        not taken from it (a last beat may race the recording)."""
        now = utcnow()
        with self._write() as s:
            s.execute(update(PoolWorker).where(PoolWorker.id == worker_id).values(heartbeat_at=now))
            if claim is None:
                return True
            row = s.get(QueuedJob, claim.job_id)
            if row is None or row.state == "CANCELLED":
                return False
            if row.state in ("DONE", "FAILED"):
                return True  # recorded already: nothing to stop (the beat raced the end)
            if row.worker_id != worker_id or row.attempts != claim.attempt:
                return False  # re-queued from under it (taken for dead)
            row.heartbeat_at = now
            if progress:
                row.progress = progress[:500]
            return True

    def live_workers(self) -> list[dict[str, Any]]:
        with self._read() as s:
            rows = s.scalars(select(PoolWorker).order_by(PoolWorker.started_at)).all()
            return [
                {
                    "id": w.id,
                    "pool_id": w.pool_id,
                    "host": w.host,
                    "pid": w.pid,
                    "slot": w.slot,
                    "capabilities": json.loads(w.capabilities_json),
                    "started_at": w.started_at,
                    "heartbeat_at": w.heartbeat_at,
                    "job_id": w.job_id,
                }
                for w in rows
                if w.slot != "pool"
            ]

    def reap_dead(self, stale_s: float = DEFAULT_STALE_S) -> list[str]:
        """Give back (or fail, past max_attempts) the jobs of dead workers; returns their
        ids. Dead: on this host, its process is gone; elsewhere, silent for `stale_s`."""
        reaped = []
        with self._write() as s:
            dead = self._drop_dead_workers(s, stale_s)
            running = s.scalars(select(QueuedJob).where(QueuedJob.state == "RUNNING")).all()
            live = set(s.scalars(select(PoolWorker.id)))
            cutoff = utcnow() - timedelta(seconds=stale_s)
            for row in running:
                why = dead.get(row.worker_id or "")
                if why is None and row.worker_id not in live:
                    why = _owner_gone(row, cutoff)
                if why is None:
                    continue
                _give_back(row, why)
                reaped.append(row.id)
        return reaped

    def _drop_dead_workers(self, s: Session, stale_s: float) -> dict[str, str]:
        """Delete rows of dead workers; returns worker id -> how it was found dead."""
        cutoff = utcnow() - timedelta(seconds=stale_s)
        dead = {}
        for w in s.scalars(select(PoolWorker)):
            if w.host == socket.gethostname():
                if not owner_alive(w.pid, w.started_at):
                    dead[w.id] = f"worker process {w.pid} on {w.host} is gone"
            elif w.heartbeat_at < cutoff:
                dead[w.id] = f"no heartbeat from {w.host} for {stale_s:g} s"
        if dead:
            s.execute(delete(PoolWorker).where(PoolWorker.id.in_(dead)))
        return dead


def _owner_gone(row: QueuedJob, cutoff: Any) -> str | None:
    """A RUNNING job whose worker has no row: a one-job runner (`orchestrate run`), seen
    dead by its pid on this host or by its silence elsewhere."""
    host, _, rest = (row.worker_id or "").partition(":")
    pid = rest.partition(":")[0]
    if host == socket.gethostname() and pid.isdigit() and row.claimed_at is not None:
        if not owner_alive(int(pid), row.claimed_at):
            return f"process {pid} on {host} is gone"
        return None
    if row.heartbeat_at is None or row.heartbeat_at < cutoff:
        return f"no heartbeat from {row.worker_id}"
    return None


def _give_back(row: QueuedJob, why: str) -> None:
    """Record how the running attempt ended; PENDING again, or FAILED listing every
    attempt once it has had `max_attempts`."""
    entry = {"attempt": row.attempts, "worker": row.worker_id, "ended": why}
    _history(row, entry | {"at": utcnow()})
    if row.attempts >= row.max_attempts:
        attempts = "; ".join(
            f"attempt {h['attempt']} on {h['worker']}: {h['ended']}"
            for h in json.loads(row.history_json)
            if "ended" in h
        )
        _end(row, "FAILED", error=f"failed after {row.attempts} attempts ({attempts})")
    else:
        row.state, row.worker_id = "PENDING", None


def _held(s: Session, claim: Claim) -> QueuedJob:
    row = s.get(QueuedJob, claim.job_id)
    if row is None:
        raise ClaimLost(f"job {claim.job_id} is no longer queued")
    if row.state != "RUNNING" or row.worker_id != claim.worker_id or row.attempts != claim.attempt:
        raise ClaimLost(
            f"job {claim.job_id} is no longer held by {claim.worker_id} (attempt "
            f"{claim.attempt}): it is {row.state}"
            + (f" on {row.worker_id}, attempt {row.attempts}" if row.worker_id else "")
        )
    return row


def _end(
    row: QueuedJob, state: str, *, run_id: str | None = None, error: str | None = None
) -> None:
    row.state, row.finished_at, row.error = state, utcnow(), error
    if run_id is not None:
        row.run_id = run_id
    if state != "RUNNING":
        row.worker_id = None


def _history(row: QueuedJob, entry: dict[str, Any]) -> None:
    history = json.loads(row.history_json)
    history.append({k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in entry.items()})
    row.history_json = json.dumps(history)


def _job_fields(row: QueuedJob) -> dict[str, Any]:
    return {
        "id": row.id,
        "state": row.state,
        "priority": row.priority,
        "label": row.label,
        "submitted_at": row.submitted_at,
        "submitted_by": row.submitted_by,
        "requirements": json.loads(row.requirements_json),
        "options": json.loads(row.options_json),
        "attempts": row.attempts,
        "max_attempts": row.max_attempts,
        "worker_id": row.worker_id,
        "device": row.device,
        "claimed_at": row.claimed_at,
        "heartbeat_at": row.heartbeat_at,
        "finished_at": row.finished_at,
        "progress": row.progress,
        "run_id": row.run_id,
        "error": row.error,
        "history": json.loads(row.history_json),
        "schema_version": row.schema_version,
    }
