"""The orchestrator's database, as one `Store`: the only place above `orchestrate.db` that
speaks SQL. Every query is a named method returning plain data; callers never hold a
session.

The methods live by concept in sibling modules, composed here:
    runs.py        run lifecycle (begin, finish, fail, ingest, reconcile), listing, results
    decisions.py   decisions, champions, the failures ledger
    scores.py      scores of a run's recordings
    holdout.py     the holdout audit
    protocols.py   protocol versions
"""

from __future__ import annotations

import socket

from sqlalchemy import func, select

from orchestrate import db
from orchestrate.db.models import Base
from orchestrate.store.decisions import DecisionsMixin
from orchestrate.store.errors import AmbiguousRun, DuplicateRun, RunNotFound, StoreError
from orchestrate.store.holdout import HoldoutMixin
from orchestrate.store.protocols import ProtocolsMixin
from orchestrate.store.runs import RunsMixin
from orchestrate.store.scores import ScoresMixin

# Callers import the errors from here, where they imported them before the split.
__all__ = ["AmbiguousRun", "DuplicateRun", "RunNotFound", "Store", "StoreError"]


class Store(RunsMixin, DecisionsMixin, ScoresMixin, HoldoutMixin, ProtocolsMixin):
    """The run database at `url` (default: $ORCHESTRATE_DB_URL, else ./orchestrate.db)."""

    def __init__(self, url: str | None = None) -> None:
        self.url = url or db.default_url()
        self.hostname = socket.gethostname()
        self._engine = db.make_engine(self.url)
        self._writer = db.writer(self._engine)
        with self._writer.begin() as conn:  # migrate to the newest schema on every open
            db.upgrade(conn)
        self.reconcile_stale()

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def count(self, table: str) -> int:
        """Rows in a table (for tests and `orchestrate db` summaries)."""
        with self._read() as s:
            return s.scalar(select(func.count()).select_from(Base.metadata.tables[table])) or 0
