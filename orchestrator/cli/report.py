"""`orchestrate report RUN|EXPLORATION`: one run or exploration as a self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrate.cli.common import DbOpt, console, fail, open_store


def report(
    ref: Annotated[
        str, typer.Argument(metavar="ID", help="A run or exploration id, or a unique prefix.")
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the page (default: reports/run-ID.html or "
            "reports/exploration-ID.html in the working folder, ID the first 12 characters)."
        ),
    ] = None,
    figures: Annotated[
        Path | None,
        typer.Option(help="Also write the page's figures as PNG files into this folder."),
    ] = None,
    db: DbOpt = None,
) -> None:
    """One page to open offline or attach to a pull request, figures and audio embedded.
    A run: settings, environment, protocol, the stacks table, fidelity, quality and a
    listening pack (every stack per prompt). An exploration: the tree of tried stacks, the
    frontier over time, the champion's ladder, the ledger and stock against the champion."""
    from orchestrate.store.errors import AmbiguousRun, RunNotFound
    from orchestrate.store.explorations import ExplorationNotFound

    store = open_store(db)
    try:
        row = store.get_exploration(ref)
    except ExplorationNotFound:
        row = None
    if row is None:
        try:
            run_id = store.resolve(ref)
        except RunNotFound:
            fail(f"no run or exploration with id {ref!r} or starting with it")
        except AmbiguousRun as exc:
            fail(str(exc))
        _run_page(store, run_id, out, figures)
        return
    _exploration_page(store, row, out, figures)


def _run_page(store: Any, run_id: str, out: Path | None, figures: Path | None) -> None:
    import base64

    from orchestrate.reports.run_page import render, view_from_store

    view = view_from_store(store, run_id)
    path = render(view, out or Path("reports") / f"run-{run_id[:12]}.html")
    clips = sum(c.clip is not None for u in view.listening for c in u.clips)
    console.print(f"wrote {path} ({len(view.rows)} stacks, {clips} clips)")
    if figures and view.headline_png:
        figures.mkdir(parents=True, exist_ok=True)
        png = figures / f"run-{run_id[:12]}-headline.png"
        png.write_bytes(base64.b64decode(view.headline_png))
        console.print(f"wrote {png}")


def _exploration_page(
    store: Any, row: dict[str, Any], out: Path | None, figures: Path | None
) -> None:
    from orchestrate.api.registry import get_family
    from orchestrate.reports.exploration_page import render, save_figures, view_from_store

    baseline = get_family(row["family"]).baseline
    view = view_from_store(store, row["id"], baseline)
    path = render(view, out or Path("reports") / f"exploration-{row['id'][:12]}.html")
    console.print(f"wrote {path} ({len(view.nodes)} candidates, {len(view.listening)} clips)")
    for png in save_figures(view, figures, f"exploration-{row['id'][:12]}") if figures else []:
        console.print(f"wrote {png}")


def register(app: typer.Typer) -> None:
    app.command()(report)
