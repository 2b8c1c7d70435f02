"""Runs: their lifecycle (begin, finish, fail, ingest, reconcile) and reading them back.

A run row is written RUNNING before a job starts (with the owning pid, so a killed
orchestrator is noticed: see reconcile_stale) and completed from the worker's ResultRecord
in one transaction. Everything returned is plain data; callers never hold a session.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, selectinload

from orchestrate.api.records import JobSpec, ResultRecord, utcnow
from orchestrate.api.registry import job_identity
from orchestrate.db.models import Run, StackResultRow
from orchestrate.store.errors import (
    AmbiguousRun,
    DuplicateRun,
    ResumeClaimed,
    RunNotFound,
    StoreError,
)
from orchestrate.store.pids import owner_alive
from orchestrate.store.rows import (
    Comparisons,
    classify_failure,
    failure_row,
    maybe_json,
    model_label,
    result_record,
    run_fields,
    stack_fields,
    write_result,
)
from orchestrate.store.sessions import Sessions


class RunsMixin(Sessions):
    """Run rows: written around a job's life, read back for listings and reports."""

    # ------------------------------------------------------------------------- writes

    def begin_run(self, job: JobSpec, identity: str) -> str:
        """Record that this process starts measuring `job`; returns the new run id.

        A resumed job claims its run here, in the same write transaction (SQLite's write
        lock is taken at BEGIN): of two resumes planned at once, the second is refused
        (ResumeClaimed, naming the first) before its worker starts."""
        try:
            with self._write() as s:
                _refuse_known_job(s, job.job_id)
                if job.resumed_from:
                    _refuse_claimed(s, job.resumed_from)
                run = self._new_run(job, identity, status="RUNNING", pid=os.getpid())
                s.add(run)
        except IntegrityError as exc:  # a concurrent writer (databases without IMMEDIATE)
            raise DuplicateRun(f"job {job.job_id} is already recorded") from exc
        return run.id

    def finish_run(
        self,
        run_id: str,
        result: ResultRecord,
        comparisons: Comparisons | None = None,
        result_path: str | None = None,
        mlflow_run_id: str | None = None,
    ) -> None:
        """Record `result` as the outcome of run `run_id`, all or nothing.

        If writing fails, nothing of the result is kept, the run is marked FAILED with the
        error (in a second transaction) and the error is raised again.
        """
        try:
            with self._write() as s:
                run = s.get(Run, run_id)
                if run is None:
                    raise RunNotFound(f"no run {run_id!r}")
                if _has_result(run):
                    raise DuplicateRun(f"run {run_id} already has a result ({run.status})")
                if result.job.job_id != run.job_id:
                    raise ValueError(
                        f"result is for job {result.job.job_id}, run {run_id} is job {run.job_id}"
                    )
                write_result(s, run, result, comparisons, result_path, mlflow_run_id)
        except (RunNotFound, DuplicateRun):
            raise  # nothing to mark: no such run, or it already holds a result
        except Exception as exc:
            self.fail_run(run_id, "FAILED", f"recording the result failed: {exc!r}")
            raise

    def fail_run(self, run_id: str, status: Literal["FAILED", "INTERRUPTED"], error: str) -> None:
        """Mark a run FAILED or INTERRUPTED and add a failures-ledger entry.

        A run that already holds a recorded result keeps its status (a later failure, e.g.
        of MLflow logging, does not undo a measurement); the ledger entry is still added.
        """
        if status not in ("FAILED", "INTERRUPTED"):
            raise ValueError(f"fail_run status must be FAILED or INTERRUPTED, not {status!r}")
        with self._write() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r}")
            if not _has_result(run):
                run.status, run.error, run.ended_at = status, error, utcnow()
            cause = "interrupted" if status == "INTERRUPTED" else classify_failure(error)
            s.add(failure_row(run_id, None, cause, error))

    def ingest(
        self,
        result: ResultRecord,
        comparisons: Comparisons | None = None,
        result_path: str | None = None,
        mlflow_run_id: str | None = None,
        identity: str | None = None,
    ) -> str:
        """Record a result produced elsewhere (e.g. on a GPU host); returns the run id.

        A job is recorded once: a second ingest of it is refused. A run of the job that
        never got its result (interrupted, or failed while recording) is completed instead.
        """
        job = result.job
        self.reconcile_stale()  # an owner that died since this store opened frees its run
        with self._write() as s:
            run = s.scalar(select(Run).where(Run.job_id == job.job_id))
            if run is None:
                run = self._new_run(job, identity or job_identity(job), status="RUNNING", pid=None)
                s.add(run)
            elif _has_result(run):
                raise DuplicateRun(
                    f"job {job.job_id} is already recorded as run {run.id} ({run.status}); "
                    "a job is ingested once"
                )
            elif run.status == "RUNNING":
                raise DuplicateRun(
                    f"job {job.job_id} is being run as {run.id} by pid {run.pid} on {run.host}"
                )
            write_result(s, run, result, comparisons, result_path, mlflow_run_id)
            return run.id

    def set_mlflow_run_ids(
        self, run_id: str, parent_id: str, stack_run_ids: dict[str, str] | None = None
    ) -> None:
        """Link a run (and its stacks, by name) to the MLflow runs it was logged as."""
        with self._write() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r}")
            run.mlflow_run_id = parent_id
            for sr in run.stack_results:
                sr.mlflow_run_id = (stack_run_ids or {}).get(sr.stack.name, sr.mlflow_run_id)

    def reconcile_stale(self) -> list[str]:
        """Mark RUNNING runs of dead orchestrator processes on this host INTERRUPTED.

        Returns the ids marked. Runs owned by other hosts are left alone (their processes
        cannot be seen from here).
        """
        query = select(Run.id, Run.pid, Run.started_at).where(
            Run.status == "RUNNING", Run.host == self.hostname
        )
        with self._read() as s:
            stale = [r.id for r in s.execute(query) if not owner_alive(r.pid, r.started_at)]
        marked = []
        for run_id in stale:
            with self._write() as s:
                run = s.get_one(Run, run_id)
                if run.status != "RUNNING":  # another process reconciled it meanwhile
                    continue
                error = f"orchestrator process {run.pid} on {run.host} ended without finishing"
                run.status, run.error, run.ended_at = "INTERRUPTED", error, utcnow()
                s.add(failure_row(run_id, None, "interrupted", error))
            marked.append(run_id)
        return marked

    def _new_run(self, job: JobSpec, identity: str, status: str, pid: int | None) -> Run:
        return Run(
            id=uuid.uuid4().hex,
            identity=identity,
            job_id=job.job_id,
            status=status,
            started_at=utcnow(),
            family=job.model.family,
            model_json=job.model.model_dump_json(),
            workload_name=job.workload.name,
            workload_json=job.workload.model_dump_json(),
            protocol_hash=job.protocol.content_hash(),
            protocol_version=job.protocol.version,
            code_sha=job.code_sha,
            host=self.hostname,
            pid=pid,
            job_json=_job_json(job),
            baseline_stack=job.baseline.name,
        )

    # ------------------------------------------------------------------------ queries

    def resumed_by(self, run_id: str) -> list[dict[str, Any]]:
        """Runs that resumed run `run_id` (`orchestrate run --resume`), oldest first, as
        {"id", "status"}: the pointer from an INTERRUPTED or FAILED run to its continuation."""
        pointer = f'"resumed_from":{json.dumps(run_id)}'
        query = (
            select(Run.id, Run.status)
            .where(Run.job_json.contains(pointer, autoescape=True))
            .order_by(Run.started_at, Run.id)
        )
        with self._read() as s:
            return [{"id": r.id, "status": r.status} for r in s.execute(query)]

    def list_runs(self, limit: int = 20, family: str | None = None) -> list[dict[str, Any]]:
        """Newest first: run fields (without the JSON blobs) and the stack names in order."""
        query = select(Run).order_by(Run.started_at.desc(), Run.id).limit(limit)
        if family is not None:
            query = query.where(Run.family == family)
        query = query.options(selectinload(Run.stack_results).selectinload(StackResultRow.stack))
        with self._read() as s:
            return [
                {
                    **run_fields(run),
                    "model": model_label(json.loads(run.model_json)),
                    "stacks": [sr.stack.name for sr in run.stack_results],
                }
                for run in s.scalars(query)
            ]

    def resolve(self, run_id_or_prefix: str) -> str:
        """The full id of the one run whose id starts with `run_id_or_prefix`."""
        prefix = run_id_or_prefix.strip().lower()
        if not prefix:
            raise RunNotFound("empty run id")
        query = select(Run.id).where(Run.id.startswith(prefix, autoescape=True)).limit(6)
        with self._read() as s:
            ids = list(s.scalars(query))
        if not ids:
            raise RunNotFound(f"no run with id {prefix!r} or starting with it")
        if len(ids) > 1 and prefix not in ids:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            raise AmbiguousRun(f"run id prefix {prefix!r} matches several runs: {shown}")
        return prefix if prefix in ids else ids[0]

    def get_run(self, run_id_or_prefix: str, utterances: bool = True) -> dict[str, Any]:
        """Run fields, decoded JSON (model, workload, job, environment) and per-stack results."""
        run_id = self.resolve(run_id_or_prefix)
        loads = [selectinload(Run.stack_results).selectinload(StackResultRow.stack)]
        loads.append(selectinload(Run.stack_results).selectinload(StackResultRow.metrics))
        if utterances:
            loads.append(selectinload(Run.stack_results).selectinload(StackResultRow.utterances))
        with self._read() as s:
            run = s.scalars(select(Run).where(Run.id == run_id).options(*loads)).one()
            out = {
                **run_fields(run),
                "model": json.loads(run.model_json),
                "workload": json.loads(run.workload_json),
                "job": json.loads(run.job_json),
                "environment": maybe_json(run.environment_json),
                "stacks": [stack_fields(sr, utterances) for sr in run.stack_results],
            }
        _mark_resumed(out["stacks"], out["job"])
        out["resumed_from"] = out["job"].get("resumed_from")
        out["resumed_by"] = [r["id"] for r in self.resumed_by(run_id)]
        return out

    def get_result(self, run_id_or_prefix: str) -> ResultRecord:
        """Rebuild the worker's ResultRecord from the database (reports need no JSON file)."""
        run = self.get_run(run_id_or_prefix)
        if run["environment"] is None:
            raise StoreError(f"run {run['id']} has no recorded result ({run['status']})")
        return result_record(run)

    def find_run_by_identity(self, identity: str) -> dict[str, Any] | None:
        """The latest FINISHED run that measured `identity` (as `get_run`, without
        utterances), or None."""
        query = (
            select(Run.id)
            .where(Run.identity == identity, Run.status == "FINISHED")
            .order_by(Run.started_at.desc())
            .limit(1)
        )
        with self._read() as s:
            run_id = s.scalar(query)
        return None if run_id is None else self.get_run(run_id, utterances=False)


def _job_json(job: JobSpec) -> str:
    """The job as stored: a job that resumes nothing leaves its empty resume fields out, so
    runs recorded before resuming existed and after it read (and diff) alike."""
    empty = {k for k in ("resumed_from", "carried", "sealed_file") if not getattr(job, k)}
    return job.model_dump_json(exclude=empty)


def _mark_resumed(stacks: list[dict[str, Any]], job: dict[str, Any]) -> None:
    """Utterances are stored without their `resumed` flag (a column would need a migration):
    it is exactly the (stack, prompt, seed) the job carried over from the resumed run."""
    carried = {
        (stack, u["prompt_id"], u["seed"])
        for stack, utts in (job.get("carried") or {}).items()
        for u in utts
    }
    for st in stacks:
        for u in st.get("utterances", []):
            u["resumed"] = (st["name"], u["prompt_id"], u["seed"]) in carried


def _has_result(run: Run) -> bool:
    # Every ResultRecord carries an environment, and only recording a result sets it.
    return run.environment_json is not None


def _refuse_claimed(s: Session, run_id: str) -> None:
    pointer = f'"resumed_from":{json.dumps(run_id)}'
    query = select(Run).where(Run.job_json.contains(pointer, autoescape=True)).limit(1)
    if (other := s.scalar(query)) is not None:
        raise ResumeClaimed(
            f"cannot resume run {run_id[:12]}: it is being resumed as run {other.id[:12]} by "
            f"pid {other.pid} on {other.host} ({other.status})"
        )


def _refuse_known_job(s: Session, job_id: str) -> None:
    known = s.scalar(select(Run).where(Run.job_id == job_id))
    if known is not None:
        raise DuplicateRun(f"job {job_id} is already recorded as run {known.id} ({known.status})")
