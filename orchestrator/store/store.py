"""The orchestrator's database, as one `Store`: the only place above `orchestrate.db` that
speaks SQL. Every query is a named method returning plain data; callers never hold a
session.

The methods live by concept in sibling modules, composed here:
    runs.py        run lifecycle (begin, finish, fail, ingest, reconcile), listing, results
    decisions.py   decisions, champions, the failures ledger
    explorations.py  explorations (`orchestrate explore`) and their candidates
    scores.py      scores of a run's recordings
    holdout.py     the holdout audit
    protocols.py   protocol versions
    queue.py       the job queue and the pool workers draining it
"""

from __future__ import annotations

import socket

from sqlalchemy import func, inspect, select
from sqlalchemy.exc import SQLAlchemyError

from orchestrate import db
from orchestrate.db.models import Base, Run
from orchestrate.store import probes
from orchestrate.store.decisions import DecisionsMixin
from orchestrate.store.errors import (
    AmbiguousRun,
    DuplicateRun,
    RunNotFound,
    StoreError,
    StoreUnavailable,
    UnknownSchema,
)
from orchestrate.store.explorations import ExplorationsMixin
from orchestrate.store.holdout import HoldoutMixin
from orchestrate.store.protocols import ProtocolsMixin
from orchestrate.store.queue import QueueMixin
from orchestrate.store.runs import RunsMixin
from orchestrate.store.scores import ScoresMixin

# Callers import the errors from here, where they imported them before the split.
__all__ = [
    "AmbiguousRun",
    "DuplicateRun",
    "RunNotFound",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "UnknownSchema",
]


class Store(
    RunsMixin,
    DecisionsMixin,
    ScoresMixin,
    HoldoutMixin,
    ProtocolsMixin,
    ExplorationsMixin,
    QueueMixin,
):
    """The run database at `url` (default: $ORCHESTRATE_DB_URL, else ./orchestrate.db).

    Opening it checks it first: a URL, path or file it cannot use raises StoreUnavailable
    with one line naming the problem and the fix, before anything is written.
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = url or db.default_url()
        self.hostname = socket.gethostname()
        target = probes.database(self.url)
        probes.check_url(target)  # not a URL, no driver, a bad or corrupted SQLite file
        self._engine = db.make_engine(self.url)
        self._writer = db.writer(self._engine)
        try:
            self.probe()
            with self._writer.begin() as conn:  # migrate to the newest schema on every open
                db.upgrade(conn)
            self.reconcile_stale()
        except db.SchemaTooNew as exc:
            self._engine.dispose()
            raise UnknownSchema(
                f"cannot use {target.label}: {exc}; upgrade orchestrate or {target.fresh}"
            ) from exc
        except (SQLAlchemyError, ImportError) as exc:
            self._engine.dispose()
            raise probes.unavailable(exc, target) from exc

    def probe(self) -> None:
        """Connect and read the catalogue: StoreUnavailable (one line) if either fails."""
        try:
            with self._engine.connect() as conn:
                inspect(conn).get_table_names()  # unlike SELECT 1, this reads the file
        except (SQLAlchemyError, ImportError) as exc:
            raise probes.unavailable(exc, probes.database(self.url)) from exc

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def runs_without_mlflow(self) -> list[str]:
        """Ids of runs holding a recorded result but no MLflow run (oldest first): what
        `orchestrate sync-mlflow` logs when MLflow was down or --no-mlflow was given."""
        query = (
            select(Run.id)
            .where(Run.mlflow_run_id.is_(None), Run.environment_json.is_not(None))
            .order_by(Run.started_at, Run.id)
        )
        with self._read() as s:
            return list(s.scalars(query))

    def count(self, table: str) -> int:
        """Rows in a table (for tests and `orchestrate db` summaries)."""
        with self._read() as s:
            return s.scalar(select(func.count()).select_from(Base.metadata.tables[table])) or 0
