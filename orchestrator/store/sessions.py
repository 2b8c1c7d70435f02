"""The base every part of the Store builds on: its engines and one session per transaction.

Sessions never leave orchestrator/store/: every query is a named Store method that returns
plain data, so nothing above the store imports SQLAlchemy or holds ORM rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError, IntegrityError
from sqlalchemy.orm import Session

from orchestrate.store import probes


class Sessions:
    """Engines and transactions; `Store.__init__` sets the attributes."""

    url: str
    hostname: str
    _engine: Engine
    # The same engine with SQLite's write lock taken at BEGIN (see db.writer).
    _writer: Engine

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """One write transaction, committed on leaving (rolled back on an exception)."""
        try:
            with Session(self._writer, expire_on_commit=False) as session, session.begin():
                yield session
        except IntegrityError:
            raise  # a constraint the caller handles (a job recorded twice), not the file
        except DatabaseError as exc:  # went away, read-only, full, locked, or corrupted
            raise probes.unavailable(exc, probes.database(self.url)) from exc

    @contextmanager
    def _read(self) -> Iterator[Session]:
        try:
            with Session(self._engine) as session:
                yield session
        except DatabaseError as exc:  # a page corrupted mid-file shows only when it is read
            raise probes.unavailable(exc, probes.database(self.url)) from exc
