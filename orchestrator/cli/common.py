"""What every `orchestrate` command shares: consoles, common options, error exit, store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

# Piped output (scripts, CI logs) gets a wide table instead of one cut to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
# Resolved by orchestrate.api.protocol.protocol_path (one resolver for every command).
ProtocolOpt = Annotated[
    str,
    typer.Option(
        "--protocol",
        help="Protocol name (configs/NAME.yaml) or YAML path (default: configs/protocol.yaml).",
    ),
]
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db", help="SQLAlchemy URL (default: $ORCHESTRATE_DB_URL or sqlite:///orchestrate.db)."
    ),
]


def fail(message: str, code: int = 2) -> NoReturn:
    # Escaped: messages quote paths, URLs and `pip install x[y]`, which are not markup.
    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}")


def open_store(db: str | None) -> Any:
    """The store at `db`; a database it cannot use ends the command with one line (exit 2)."""
    from orchestrate.store import probes
    from orchestrate.store.store import Store, StoreError  # lazily: `worker` needs no SQL

    try:
        probes.refuse_shared_tracking(db or probes.default_db_url())  # before either opens
        return Store(db)
    except StoreError as exc:
        fail(str(exc))


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def output_dir(db: str | None) -> Path:
    """Where a command writes its files unless told: beside the SQLite database, in a folder
    named after it (`orchestrate-reports/` beside `orchestrate.db`: one per database), else
    `orchestrate-reports/` in the working folder; never into the installed package."""
    from orchestrate.store import probes

    path = probes.database_file(db or probes.default_db_url())
    return Path("orchestrate-reports") if path is None else path.parent / f"{path.stem}-reports"


def last_workload(store: Any) -> str:
    """The workload the database last ran (its base name: `smoke` for `smoke@holdout`), or
    `smoke` for an empty one: what frontier and figures show unless told."""
    newest = store.list_runs(limit=1)
    return (newest[0].get("workload_name") or "smoke").split("@")[0] if newest else "smoke"
