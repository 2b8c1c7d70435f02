"""Alembic environment for the orchestrator database.

db.migrate()/db.upgrade() hand in a connection that is already inside a transaction; the
alembic CLI (alembic -c db/migrations/alembic.ini ...) gets an engine from the URL in the
config, $ORCHESTRATE_DB_URL, or ./orchestrate.db, in that order.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from orchestrate import db
from orchestrate.db.models import Base

config = context.config
target_metadata = Base.metadata
if config.config_file_name is not None:  # the CLI; db.migrate leaves the app's logging be
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or db.default_url()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = db.make_engine(_url())
    try:
        with db.writer(engine).begin() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
