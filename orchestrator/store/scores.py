"""Scores of a run's recordings: one row per utterance and scorer (a score, or a coverage
failure saying why the utterance could not be scored).

Rows cross this boundary as plain dicts with the fields of
`orchestrate.research.scoring_run.ScoreRow` (the store sits below research and cannot
import it): stack, utterance (index in the stack's utterance list), scorer, scorer_version,
kind, reference, weights_id, status, values, details, resample, packages, error; reading
adds prompt_id, seed and round from the utterance.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrate.db.models import Run, ScoreEntry, Stack, StackResultRow, Utterance
from orchestrate.store.sessions import Sessions


class ScoresMixin(Sessions):
    """The score_entries table, keyed by utterance, scorer, scorer version and weights."""

    def add_scores(
        self,
        run_id: str,
        job_id: str,
        rows: Iterable[Mapping[str, Any]],
        *,
        created_at: datetime,
        protocol_hash: str,
        host: str,
    ) -> int:
        """Add score rows for run `run_id` (whose job must be `job_id`), all or nothing;
        rows already stored (same utterance, scorer, version and weights) are left as they
        are. Returns the number of rows added."""
        with self._write() as s:
            run = s.get(Run, run_id)
            if run is None or run.job_id != job_id:
                raise ValueError(f"score sheet is for job {job_id}, not run {run_id}")
            ids = _utterance_ids(s, run_id)
            keys = select(
                ScoreEntry.utterance_id,
                ScoreEntry.scorer,
                ScoreEntry.scorer_version,
                ScoreEntry.weights_id,
            ).where(ScoreEntry.utterance_id.in_(ids.values()))
            existing = {tuple(row) for row in s.execute(keys)}
            added = 0
            for r in rows:
                uid = ids.get((r["stack"], r["utterance"]))
                if uid is None:
                    raise ValueError(
                        f"run {run_id} has no utterance {r['utterance']} of {r['stack']}"
                    )
                key = (uid, r["scorer"], r["scorer_version"], r["weights_id"])
                if key in existing:
                    continue
                existing.add(key)
                s.add(_entry(uid, r, created_at, protocol_hash, host))
                added += 1
            return added

    def list_scores(self, run_id: str) -> list[dict[str, Any]]:
        """Every stored score of run `run_id`'s recordings, in stack, utterance and scorer
        order, as ScoreRow fields (JSON columns decoded)."""
        query = (
            select(ScoreEntry, Stack.name, Utterance)
            .join(Utterance, ScoreEntry.utterance_id == Utterance.id)
            .join(StackResultRow, Utterance.stack_result_id == StackResultRow.id)
            .join(Stack, StackResultRow.stack_id == Stack.id)
            .where(StackResultRow.run_id == run_id)
            .order_by(StackResultRow.position, Utterance.position, ScoreEntry.scorer)
        )
        with self._read() as s:
            return [
                {
                    "stack": name,
                    "utterance": u.position,
                    "prompt_id": u.prompt_id,
                    "seed": u.seed,
                    "round": u.round,
                    "scorer": e.scorer,
                    "scorer_version": e.scorer_version,
                    "kind": e.kind,
                    "reference": e.reference,
                    "weights_id": e.weights_id,
                    "status": e.status,
                    "values": json.loads(e.values_json),
                    "details": json.loads(e.details_json),
                    "resample": None if e.resample_json is None else json.loads(e.resample_json),
                    "packages": json.loads(e.packages_json),
                    "error": e.error,
                }
                for e, name, u in s.execute(query)
            ]


def _utterance_ids(s: Session, run_id: str) -> dict[tuple[str, int], int]:
    # Inside add_scores's transaction: (stack name, utterance index) -> utterance row id.
    query = (
        select(Stack.name, Utterance.position, Utterance.id)
        .join(StackResultRow, StackResultRow.stack_id == Stack.id)
        .join(Utterance, Utterance.stack_result_id == StackResultRow.id)
        .where(StackResultRow.run_id == run_id)
    )
    return {(name, pos): uid for name, pos, uid in s.execute(query)}


def _entry(
    uid: int, r: Mapping[str, Any], created_at: datetime, protocol_hash: str, host: str
) -> ScoreEntry:
    return ScoreEntry(
        created_at=created_at,
        utterance_id=uid,
        scorer=r["scorer"],
        scorer_version=r["scorer_version"],
        kind=r["kind"],
        reference=r["reference"],
        weights_id=r["weights_id"],
        status=r["status"],
        values_json=json.dumps(r["values"]),
        details_json=json.dumps(r["details"]),
        resample_json=None if r["resample"] is None else json.dumps(r["resample"]),
        packages_json=json.dumps(r["packages"]),
        error=r["error"],
        protocol_hash=protocol_hash,
        host=host,
    )
