"""`orchestrate report EXPLORATION`: one exploration as a self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from orchestrate.cli.common import DbOpt, console, open_store


def report(
    exploration: Annotated[str, typer.Argument(help="Exploration id or a unique prefix.")],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the page (default: reports/exploration-ID.html in the "
            "working folder, ID the exploration id's first 12 characters)."
        ),
    ] = None,
    figures: Annotated[
        Path | None,
        typer.Option(help="Also write the page's figures as PNG files into this folder."),
    ] = None,
    db: DbOpt = None,
) -> None:
    """The tree of tried stacks, the frontier over time, the champion's ladder, the ledger
    and a listening pack (stock against the champion), figures and audio embedded."""
    from orchestrate.api.registry import get_family
    from orchestrate.reports.exploration_page import render, save_figures, view_from_store

    store = open_store(db)
    row = store.get_exploration(exploration)
    baseline = get_family(row["family"]).baseline
    view = view_from_store(store, row["id"], baseline)
    path = render(view, out or Path("reports") / f"exploration-{row['id'][:12]}.html")
    console.print(f"wrote {path} ({len(view.nodes)} candidates, {len(view.listening)} clips)")
    for png in save_figures(view, figures, f"exploration-{row['id'][:12]}") if figures else []:
        console.print(f"wrote {png}")


def register(app: typer.Typer) -> None:
    app.command()(report)
