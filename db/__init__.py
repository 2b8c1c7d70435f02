"""The orchestrator's database: engine set-up and schema migrations.

Any SQLAlchemy URL works; the default is a SQLite file in the current directory. The worker
side never imports this package (a GPU host needs no database).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, make_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DEFAULT_URL = "sqlite:///orchestrate.db"
URL_ENV = "ORCHESTRATE_DB_URL"
# Seconds a writer waits for another writer's lock before giving up ("database is locked"
# on SQLite, "lock timeout" on PostgreSQL).
WRITE_LOCK_WAIT_S = 30.0
# Execution option that makes a transaction take the database's one write lock at BEGIN.
IMMEDIATE = "orchestrate_sqlite_immediate"
# PostgreSQL advisory lock keys (any two constants; advisory locks are per database):
# writers take WRITER_LOCK as SQLite's writers take its write lock, and a migration takes
# MIGRATION_LOCK before it reads the schema revision.
WRITER_LOCK, MIGRATION_LOCK = 0x6F72_6368_0001, 0x6F72_6368_0002


class SchemaTooNew(RuntimeError):
    """The database's schema revision is unknown here (written by a newer orchestrate)."""


def default_url() -> str:
    return os.environ.get(URL_ENV) or DEFAULT_URL


def make_engine(url: str | None = None) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout, foreign keys and real BEGINs;
    PostgreSQL gets READ COMMITTED and one write lock (see writer)."""
    url = url or default_url()
    backend = make_url(url).get_backend_name()
    # hide_parameters: an error must not print a whole job's JSON (the SQL parameters).
    if backend == "postgresql":
        # READ COMMITTED whatever the server's default: each statement after the write lock
        # is taken sees every transaction committed before it (a snapshot taken at the
        # first statement, as REPEATABLE READ takes it, would predate the lock).
        engine = create_engine(
            url, pool_pre_ping=True, hide_parameters=True, isolation_level="READ COMMITTED"
        )
        event.listen(engine, "begin", _postgresql_on_begin)
        return engine
    if backend != "sqlite":
        return create_engine(url, pool_pre_ping=True, hide_parameters=True)
    engine = create_engine(url, hide_parameters=True)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def writer(engine: Engine) -> Engine:
    """The same engine, but its transactions take the database's write lock up front.

    In WAL mode a deferred transaction that has read and then tries to write after another
    writer committed fails at once with "database is locked" (the busy timeout does not
    apply to that upgrade), so transactions that write begin IMMEDIATE and queue instead.

    On PostgreSQL they take one advisory lock (WRITER_LOCK) first, so writers run one at a
    time there too: every check-then-write of the store (a job recorded once, a resume
    claimed once, a stack stored once, a claim not reaped while it is recorded) holds on
    both. Readers never wait for it. Other databases ignore the option.
    """
    return engine.execution_options(**{IMMEDIATE: True})


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # Take BEGIN away from the sqlite3 module: its legacy mode does not begin a transaction
    # before SELECT or DDL, which breaks atomicity and savepoints. _sqlite_on_begin emits it.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")  # readers no longer block the writer
        cursor.execute(f"PRAGMA busy_timeout={int(WRITE_LOCK_WAIT_S * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")  # SQLite ignores foreign keys unless asked
        cursor.execute("PRAGMA synchronous=NORMAL")  # durable enough with WAL, much faster
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    immediate = conn.get_execution_options().get(IMMEDIATE, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _postgresql_on_begin(conn: Connection) -> None:
    if not conn.get_execution_options().get(IMMEDIATE, False):
        return
    # As SQLite's busy timeout: a writer stuck behind another fails, it does not hang.
    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(WRITE_LOCK_WAIT_S * 1000)}ms'")
    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITER_LOCK})")


def upgrade(connection: Connection) -> None:
    """Upgrade the database behind `connection` to the newest revision, in one transaction.

    The caller's transaction is used so that on SQLite two processes opening a fresh
    database at once cannot both try to create the tables: the second waits for the write
    lock, then finds the schema already at head. PostgreSQL has no such lock on a read, so
    a transaction-scoped advisory lock (MIGRATION_LOCK) is taken before the revision is
    read; its DDL is transactional, so a failed migration leaves the old schema whole.
    """
    from alembic import command
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
    cfg = _alembic_config(connection)
    script = ScriptDirectory.from_config(cfg)
    current = MigrationContext.configure(connection).get_current_revision()
    if current == script.get_current_head():
        return  # the common case: skip running env.py (and alembic's log lines)
    if current is not None and current not in {r.revision for r in script.walk_revisions()}:
        raise SchemaTooNew(
            f"database schema revision {current!r} is unknown to this version of orchestrate "
            "(was the database written by a newer one?)"
        )
    command.upgrade(cfg, "head")


def migrate(url: str | None = None) -> None:
    """Upgrade the database at `url` (default: $ORCHESTRATE_DB_URL or ./orchestrate.db)."""
    engine = make_engine(url)
    try:
        with writer(engine).begin() as conn:
            upgrade(conn)
    finally:
        engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config(None)).get_current_head()
    assert head is not None, "no migrations found"
    return head


def _alembic_config(connection: Connection | None) -> Any:
    from alembic.config import Config

    # Built in code so that no alembic.ini is needed at runtime (migrations/alembic.ini is
    # only for developers running the alembic CLI).
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg
