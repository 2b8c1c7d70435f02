"""Explorations and their candidates: the rows `orchestrate explore` keeps as its journal.

What a candidate is and how it is judged is the explore room's business
(orchestrate.explore); this module only writes and reads the rows. An exploration row is
RUNNING while its process lives (pid and host, as for runs), and a candidate is written
`open` before its first job and `decided` after its last, so `explore --resume` knows
exactly what was in flight when a process was killed.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from sqlalchemy import func, select

from orchestrate.api.records import utcnow
from orchestrate.db.models import Exploration, ExplorationCandidate, Run, columns
from orchestrate.store.errors import StoreError
from orchestrate.store.pids import owner_alive
from orchestrate.store.sessions import Sessions

# Columns holding JSON, decoded on the way out (key without the suffix).
_JSON = (
    "model_json",
    "workload_json",
    "protocol_json",
    "root_json",
    "champion_json",
    "options_json",
    "spec_json",
    "run_ids_json",
    "steps_json",
)


class ExplorationNotFound(StoreError, LookupError):
    pass


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if key in _JSON:
            out[key.removesuffix("_json")] = None if value is None else json.loads(value)
        else:
            out[key] = value
    return out


def _encoded(fields: dict[str, Any]) -> dict[str, Any]:
    """Plain values for the columns: `champion=...` is stored as champion_json, etc."""
    out = {}
    for key, value in fields.items():
        if f"{key}_json" in _JSON:
            out[f"{key}_json"] = None if value is None else json.dumps(value, default=str)
        else:
            out[key] = value
    return out


class ExplorationsMixin(Sessions):
    """The explorations and exploration_candidates tables."""

    # ------------------------------------------------------------------ explorations

    def begin_exploration(self, **fields: Any) -> str:
        """A new RUNNING exploration owned by this process; returns its id. `fields` are
        the columns (JSON ones without their `_json` suffix, as plain data)."""
        row = Exploration(
            id=uuid.uuid4().hex,
            started_at=utcnow(),
            status="RUNNING",
            host=self.hostname,
            pid=os.getpid(),
            elapsed_s=0.0,
            jobs=0,
            **_encoded(fields),
        )
        with self._write() as s:
            s.add(row)
        return row.id

    def claim_exploration(self, exploration_id: str) -> None:
        """This process takes over an exploration (`--resume`): RUNNING, with its pid."""
        self.update_exploration(
            exploration_id,
            status="RUNNING",
            pid=os.getpid(),
            host=self.hostname,
            ended_at=None,
            stop_reason=None,
        )

    def update_exploration(self, exploration_id: str, **fields: Any) -> None:
        with self._write() as s:
            row = s.get(Exploration, exploration_id)
            if row is None:
                raise ExplorationNotFound(f"no exploration {exploration_id!r}")
            for key, value in _encoded(fields).items():
                setattr(row, key, value)

    def resolve_exploration(self, id_or_prefix: str) -> str:
        prefix = id_or_prefix.strip().lower()
        query = select(Exploration.id).where(Exploration.id.startswith(prefix, autoescape=True))
        with self._read() as s:
            ids = list(s.scalars(query.limit(6))) if prefix else []
        if not ids:
            raise ExplorationNotFound(
                f"no exploration with id {id_or_prefix!r} or starting with it"
            )
        if len(ids) > 1 and prefix not in ids:
            raise ExplorationNotFound(
                f"exploration id prefix {prefix!r} matches several: {', '.join(ids[:5])}"
            )
        return prefix if prefix in ids else ids[0]

    def get_exploration(self, id_or_prefix: str) -> dict[str, Any]:
        """An exploration's columns (JSON decoded), with `candidates` (oldest first)."""
        self.reconcile_explorations()
        exploration_id = self.resolve_exploration(id_or_prefix)
        with self._read() as s:
            row = _decoded(columns(s.get_one(Exploration, exploration_id)))
        return row | {"candidates": self.list_candidates(exploration_id)}

    def list_explorations(self, limit: int = 20) -> list[dict[str, Any]]:
        """Newest first, with how many candidates each has (JSON decoded, no candidates)."""
        self.reconcile_explorations()
        counts = (
            select(ExplorationCandidate.exploration_id, func.count().label("n"))
            .group_by(ExplorationCandidate.exploration_id)
            .subquery()
        )
        query = (
            select(Exploration, counts.c.n)
            .outerjoin(counts, counts.c.exploration_id == Exploration.id)
            .order_by(Exploration.started_at.desc())
            .limit(limit)
        )
        with self._read() as s:
            return [_decoded(columns(e)) | {"candidates": n or 0} for e, n in s.execute(query)]

    def reconcile_explorations(self) -> list[str]:
        """RUNNING explorations of dead processes on this host become INTERRUPTED."""
        query = select(Exploration).where(
            Exploration.status == "RUNNING", Exploration.host == self.hostname
        )
        marked = []
        with self._write() as s:
            for row in s.scalars(query):
                if not owner_alive(row.pid, row.started_at):
                    row.status, row.ended_at = "INTERRUPTED", utcnow()
                    row.stop_reason = f"process {row.pid} on {row.host} ended without finishing"
                    marked.append(row.id)
        return marked

    # -------------------------------------------------------------------- candidates

    def add_candidate(self, exploration_id: str, **fields: Any) -> dict[str, Any]:
        """A new candidate row (next `seq`), `open` unless `status` says otherwise."""
        with self._write() as s:
            seq = (
                s.scalar(
                    select(func.max(ExplorationCandidate.seq)).where(
                        ExplorationCandidate.exploration_id == exploration_id
                    )
                )
                or 0
            ) + 1
            row = ExplorationCandidate(
                exploration_id=exploration_id,
                seq=seq,
                created_at=utcnow(),
                **_encoded({"status": "open", "run_ids": [], "steps": []} | fields),
            )
            s.add(row)
            s.flush()
            return _decoded(columns(row))

    def update_candidate(self, candidate_id: int, **fields: Any) -> None:
        if fields.get("status") == "decided":
            fields.setdefault("decided_at", utcnow())
        with self._write() as s:
            row = s.get_one(ExplorationCandidate, candidate_id)
            for key, value in _encoded(fields).items():
                setattr(row, key, value)

    def list_candidates(self, exploration_id: str) -> list[dict[str, Any]]:
        query = (
            select(ExplorationCandidate)
            .where(ExplorationCandidate.exploration_id == exploration_id)
            .order_by(ExplorationCandidate.seq)
        )
        with self._read() as s:
            return [_decoded(columns(r)) for r in s.scalars(query)]

    def run_of_job(self, job_id: str) -> dict[str, Any] | None:
        """{"id", "status"} of the run that measured job `job_id`, or None: how a resumed
        exploration finds what became of the job it had in flight."""
        with self._read() as s:
            row = s.execute(select(Run.id, Run.status).where(Run.job_id == job_id)).first()
        return None if row is None else {"id": row.id, "status": row.status}
