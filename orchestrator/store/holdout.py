"""The holdout audit: a row for every sanctioned opening of a sealed holdout, closed later
with the verdict, and for every plan refused for holding holdout text. Who may open a
holdout, and what gets flagged, is research's business (orchestrate.research.holdout); this
module only writes and reads the rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from orchestrate.api.records import utcnow
from orchestrate.db.models import HoldoutAudit, columns
from orchestrate.store.sessions import Sessions

# Given the earlier openings of the same holdout (holdout_audit columns, oldest first), the
# flags to raise against the stack now opening it.
Flagger = Callable[[list[dict[str, Any]]], list[str]]


class HoldoutMixin(Sessions):
    """The holdout_audit table."""

    def open_holdout_audit(
        self,
        *,
        workload_name: str,
        holdout_hash: str,
        stack_name: str,
        stack_hash: str,
        lineage: str,
        protocol_hash: str,
        holder: str,
        flag: Flagger,
    ) -> tuple[int, list[str]]:
        """Add an 'opened' audit row for a stack about to see this holdout, flagged by
        `flag` applied to the earlier openings. Returns (audit id, flags).

        The earlier openings are read in the same write transaction as the insert, so two
        processes opening the holdout at once see each other.
        """
        with self._write() as s:
            prior = s.scalars(
                select(HoldoutAudit)
                .where(
                    HoldoutAudit.workload_name == workload_name,
                    HoldoutAudit.holdout_hash == holdout_hash,
                )
                .order_by(HoldoutAudit.opened_at)
            ).all()
            flags = flag([columns(p) for p in prior])
            row = HoldoutAudit(
                opened_at=utcnow(),
                workload_name=workload_name,
                holdout_hash=holdout_hash,
                stack_name=stack_name,
                stack_hash=stack_hash,
                lineage=lineage,
                protocol_hash=protocol_hash,
                status="opened",
                flagged=bool(flags),
                flags_json=json.dumps(flags),
                detail_json=json.dumps({"holder": holder}),
            )
            s.add(row)
            s.flush()  # assigns the id
            return row.id, flags

    def record_holdout_refusal(
        self,
        *,
        workload_name: str,
        holdout_hash: str,
        stack_name: str,
        stack_hash: str,
        lineage: str,
        protocol_hash: str,
        detail: dict[str, Any],
    ) -> int:
        """Add a closed audit row for a plan refused because its workload held holdout
        text: status 'error' (the statuses are fixed without a migration), no run, not
        flagged; `detail` says what was refused ("outcome"). Returns the audit id."""
        now = utcnow()
        with self._write() as s:
            row = HoldoutAudit(
                opened_at=now,
                closed_at=now,
                workload_name=workload_name,
                holdout_hash=holdout_hash,
                stack_name=stack_name,
                stack_hash=stack_hash,
                lineage=lineage,
                protocol_hash=protocol_hash,
                status="error",
                flagged=False,
                flags_json="[]",
                detail_json=json.dumps(detail, default=str),
            )
            s.add(row)
            s.flush()  # assigns the id
            return row.id

    def close_holdout_audit(
        self, audit_id: int, status: str, run_id: str | None, detail: dict[str, Any]
    ) -> None:
        """Close audit row `audit_id` with the verdict `status` and the run that saw the
        holdout; `detail` is merged into the row's detail."""
        with self._write() as s:
            row = s.get_one(HoldoutAudit, audit_id)
            row.status, row.run_id, row.closed_at = status, run_id, utcnow()
            row.detail_json = json.dumps({**json.loads(row.detail_json), **detail}, default=str)

    def list_holdout_audits(self, workload_name: str | None = None) -> list[dict[str, Any]]:
        """Holdout openings, oldest first: audit columns, with flags and detail decoded (in
        place of flags_json and detail_json)."""
        query = select(HoldoutAudit).order_by(HoldoutAudit.opened_at, HoldoutAudit.id)
        if workload_name is not None:
            query = query.where(HoldoutAudit.workload_name == workload_name)
        with self._read() as s:
            rows = [columns(r) for r in s.scalars(query)]
        for r in rows:
            r["flags"] = json.loads(r.pop("flags_json"))
            r["detail"] = json.loads(r.pop("detail_json"))
        return rows
