"""The record of judgement: decisions (accept/retain), champions, and the failures ledger.

What a verdict is, and when a candidate is accepted, is research's business
(orchestrate.research.decide); this module only writes and reads the rows.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from sqlalchemy import select

from orchestrate.api.config import StackSpec
from orchestrate.api.records import utcnow
from orchestrate.db.models import Champion, Decision, Failure, Stack, StackResultRow, columns
from orchestrate.store.rows import failure_cause, failure_row
from orchestrate.store.sessions import Sessions

# Ledger causes that failures.cause (a closed set, db.models.FAILURE_CAUSES) cannot hold:
# stored under the nearest cause with the fact first in the detail (`below the noise bar:
# ...`), and named again when read (ledger_cause). No migration for a label.
NOISE_BAR = "below the noise bar"  # faster than its parent, but the CI did not clear the bar
NOISY = "noisy run"  # may be faster, but timed in a job whose figures are not to be trusted
STORED_AS = {NOISE_BAR: "slower", NOISY: "slower"}
CRASHES = ("oom", "crash", "compile", "other")  # classified from the message: re-read as facts


def stored_cause(cause: str) -> str:
    """The failures.cause value a ledger cause is stored under."""
    return STORED_AS.get(cause, cause)


def ledger_cause(cause: str, detail: str | None) -> str:
    """A stored failure's cause as a fact: the label a stored cause stands for (its detail
    starts with it), and crashes re-read from their message (rows.failure_cause), so rows
    stored before the cause was factual (a SIGKILL filed as `oom`) read right too."""
    text = detail or ""
    for label, stored in STORED_AS.items():
        if cause == stored and text.startswith(f"{label}:"):
            return label
    return failure_cause(text) if cause in CRASHES else cause


class DecisionsMixin(Sessions):
    """Decisions and champions (one per family, model, workload and hardware at a time),
    and the failures ledger that explains every retained or failed stack."""

    # -------------------------------------------------------------- decisions, champions

    def record_decision(
        self,
        *,
        run_id: str,
        stack: StackSpec,
        verdict: Literal["accept", "retain"],
        reasons: dict[str, Any],
        protocol_hash: str,
        family: str,
        model: str,
        workload: str,
        hardware: str,
        speedup: float,
    ) -> tuple[int | None, int | None]:
        """Store a verdict on `stack` as measured in run `run_id`, in one transaction: a
        decisions row, and for an accept a champions row. Returns (decision id, champion
        id); the decision id is None when the run holds no result for the stack (a worker
        that died outright), the champion id None for a retain."""
        spec_hash = stack.content_hash()
        decision_id = champion_id = None
        with self._write() as s:
            sr_id = s.scalar(
                select(StackResultRow.id)
                .join(Stack, StackResultRow.stack_id == Stack.id)
                .where(StackResultRow.run_id == run_id, Stack.spec_hash == spec_hash)
            )
            if sr_id is not None:
                row = Decision(
                    created_at=utcnow(),
                    stack_result_id=sr_id,
                    family=family,
                    workload_name=workload,
                    hardware=hardware,
                    verdict=verdict,
                    reasons_json=json.dumps(reasons, default=str),
                    protocol_hash=protocol_hash,
                )
                s.add(row)
                s.flush()  # assigns the id the champion row refers to
                decision_id = row.id
            if verdict == "accept":
                champ = Champion(
                    created_at=utcnow(),
                    family=family,
                    model=model,
                    workload_name=workload,
                    hardware=hardware,
                    stack_name=stack.name,
                    stack_hash=spec_hash,
                    spec_json=stack.model_dump_json(),
                    decision_id=decision_id,
                    protocol_hash=protocol_hash,
                    speedup=speedup,
                )
                s.add(champ)
                s.flush()
                champion_id = champ.id
        return decision_id, champion_id

    def set_champion_mlflow_model(self, champion_id: int, mlflow_model: str | None) -> None:
        """Link a champion to the MLflow registered model (alias) it was marked as."""
        with self._write() as s:
            s.get_one(Champion, champion_id).mlflow_model = mlflow_model

    def current_champion(
        self, family: str, model: str, workload: str, hardware: str
    ) -> dict[str, Any] | None:
        """The newest champions row (all columns) for this family, model, workload and
        hardware, or None."""
        query = (
            select(Champion)
            .where(
                Champion.family == family,
                Champion.model == model,
                Champion.workload_name == workload,
                Champion.hardware == hardware,
            )
            .order_by(Champion.created_at.desc(), Champion.id.desc())
            .limit(1)
        )
        with self._read() as s:
            row = s.scalar(query)
            return None if row is None else columns(row)

    def list_champions(self) -> list[dict[str, Any]]:
        """Every champions row (all columns), oldest first."""
        with self._read() as s:
            return [columns(r) for r in s.scalars(select(Champion).order_by(Champion.created_at))]

    def list_decisions(self, workload: str | None = None) -> list[dict[str, Any]]:
        """Verdicts, oldest first, with the stack they judged (name, spec hash), the run it
        was measured in, and the decoded reasons."""
        query = (
            select(Decision, Stack.name, Stack.spec_hash, StackResultRow.run_id)
            .join(StackResultRow, Decision.stack_result_id == StackResultRow.id)
            .join(Stack, StackResultRow.stack_id == Stack.id)
            .order_by(Decision.created_at, Decision.id)
        )
        if workload is not None:
            query = query.where(Decision.workload_name == workload)
        with self._read() as s:
            return [
                {
                    "id": d.id,
                    "created_at": d.created_at,
                    "verdict": d.verdict,
                    "stack": name,
                    "spec_hash": spec_hash,
                    "run_id": run_id,
                    "family": d.family,
                    "workload_name": d.workload_name,
                    "hardware": d.hardware,
                    "protocol_hash": d.protocol_hash,
                    "reasons": json.loads(d.reasons_json),
                }
                for d, name, spec_hash, run_id in s.execute(query)
            ]

    # ------------------------------------------------------------------ failures ledger

    def record_failure(
        self, stack_name: str | None, cause: str, detail: str, run_id: str | None = None
    ) -> None:
        """Add a failures-ledger entry (e.g. 'slower' or 'gate' from the accept protocol); a
        cause the table cannot hold (NOISE_BAR, NOISY) is stored as STORED_AS says, named in the
        detail."""
        stored = stored_cause(cause)
        if stored != cause:
            detail = f"{cause}: {detail}"
        with self._write() as s:
            s.add(failure_row(run_id, stack_name, stored, detail))

    def list_failures(self, limit: int = 100, run_id: str | None = None) -> list[dict[str, Any]]:
        """Failures-ledger entries (all columns), newest first."""
        query = select(Failure).order_by(Failure.created_at.desc(), Failure.id.desc()).limit(limit)
        if run_id is not None:
            query = query.where(Failure.run_id == run_id)
        with self._read() as s:
            return [columns(f) for f in s.scalars(query)]
