"""What every `orchestrate` command shares: consoles, common options, error exit, store."""

from __future__ import annotations

import json
import sys
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
    from orchestrate.store.store import Store, StoreError  # lazily: `worker` needs no SQL

    try:
        return Store(db)
    except StoreError as exc:
        fail(str(exc))


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
