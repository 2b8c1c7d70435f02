"""`orchestrate sync-mlflow`, and one line for a storage fault in any command.

Registered into the main app by cli/app.py (`faults_cli.register(app)`, after the other
groups): it adds sync-mlflow, and wraps every registered command so that a StoreError
escaping it (a database, runs folder or MLflow store found unusable mid-command, e.g. by
`run`'s checks before its worker starts) ends the command with its one-line message and
exit 2, as `open_store` does for the database at the start of each command.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any

import typer

from orchestrate.cli.common import DbOpt, JsonOpt, console, fail, open_store, print_json, warn
from orchestrate.store.errors import StoreError


def sync_mlflow(
    run_ids: Annotated[
        list[str] | None,
        typer.Argument(
            help="Run ids or prefixes (default: every run with a result and no MLflow run)."
        ),
    ] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Log recorded runs to MLflow: those it missed (MLflow down, --no-mlflow) or the named."""
    from orchestrate.running.mlflow_log import probe_tracking
    from orchestrate.running.mlflow_log import sync_mlflow as sync

    store = open_store(db)
    probe_tracking()  # an unusable MLflow store: one line, before any run is read
    done = sync(store, run_ids or None)
    if as_json:
        print_json([s._asdict() for s in done])
    elif not done:
        console.print("nothing to log: every recorded run has an MLflow run")
    for s in [] if as_json else done:
        if s.error:
            warn(f"run {s.run_id} not logged: {s.error}")
        else:
            console.print(f"run {s.run_id}: logged as MLflow run {s.mlflow_run_id}")
    if any(s.error for s in done):
        raise typer.Exit(1)


def one_line_faults(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command`, with a StoreError it raises turned into its one line and exit 2."""

    @functools.wraps(command)  # typer reads the signature through __wrapped__
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except StoreError as exc:
            fail(str(exc))

    return wrapper


def register(app: typer.Typer) -> None:
    app.command("sync-mlflow")(sync_mlflow)
    for info in app.registered_commands:
        if info.callback is not None:
            info.callback = one_line_faults(info.callback)
