"""`orchestrate noise | score | gate | ledger | frontier | figures`: the research protocol.

The loop these commands enforce:
  noise (stock vs itself, N repeats -> gates written into a new protocol version)
  -> development ladder (`orchestrate run`, dev prompts only)
  -> gate: fresh post-warm-up remeasure on dev prompts; only a candidate faster beyond noise
     opens the sealed holdout; holdout run scored; accept (new champion) or retain, with
     the reasons; every rejection lands in the failure ledger
  -> ledger, frontier, figures: regenerated from stored records.

Registered into the main app by cli/app.py (`protocol_cli.register(app)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from orchestrate.api import protocol as proto
from orchestrate.api.config import (
    ConfigError,
    load_model_spec,
    load_stack,
    load_workload,
)
from orchestrate.api.protocol import load_protocol
from orchestrate.api.registry import StackError, get_family
from orchestrate.api.sealed import HoldoutLeak
from orchestrate.cli.common import (
    DbOpt,
    JsonOpt,
    ProtocolOpt,
    console,
    err,
    fail,
    last_workload,
    open_store,
    output_dir,
    print_json,
)
from orchestrate.reports.tables import ReadableTable
from orchestrate.research import gate as gate_pipeline
from orchestrate.research.holdout import audit_refusal
from orchestrate.running.metrics import AGGREGATE, AGGREGATE_LABEL, EXACT_CELL, headline_label

# `orchestrate gate` exits 0 on accept and EXIT_RETAIN on retain (2: bad input or storage,
# 1: scoring failed, 130: interrupted); README "Exit codes".
EXIT_RETAIN = 3
# `orchestrate noise` exits EXIT_TOO_NOISY when the A/A spread exceeds noise.max_aa_cv.
EXIT_TOO_NOISY = 4
MAX_REPEATS = 50  # A/A jobs of `noise`: each is a whole run; more is a typo, not a plan

ModelOpt = Annotated[
    str, typer.Option(help="Model preset (configs/models/) or a local weights folder.")
]
WorkloadOpt = Annotated[
    str | None,
    typer.Option(help="Development workload name or YAML path (default: the family's)."),
]
LastWorkloadOpt = Annotated[
    str | None,
    typer.Option(help="Workload name or YAML path (default: the one the database last ran)."),
]
RunsDirOpt = Annotated[Path, typer.Option(help="Where jobs, results and WAVs are written.")]


def _events(quiet: bool) -> Any:
    def on_event(event: dict[str, Any]) -> None:
        if not quiet and event.get("event") == "status":
            err.print(f"[dim]{event['message']}[/dim]")

    return on_event


# -------------------------------------------------------------------------------- noise


def noise(
    stack: Annotated[
        str | None,
        typer.Option(
            "--stack", "-s", help="Stack measured against itself (default: the family's baseline)."
        ),
    ] = None,
    repeats: Annotated[int, typer.Option(help="A/A jobs (>= 2), seeds shifted per repeat.")] = 3,
    model: ModelOpt = "tiny",
    workload: WorkloadOpt = None,
    protocol: ProtocolOpt = "protocol",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where the new protocol version goes (default: protocols/NAME-vN.yaml beside "
            "the --protocol file; never over it unless named here)."
        ),
    ] = None,
    mlflow: Annotated[bool, typer.Option(help="Log the A/A runs to MLflow too.")] = True,
    runs_dir: RunsDirOpt = Path("runs"),
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure run-to-run noise of every metric and write gates into a new protocol version."""
    from orchestrate.api.scoring import ScoringError
    from orchestrate.research import noise as noise_mod

    if not 2 <= repeats <= MAX_REPEATS:  # a bad option: exit 2 before anything is opened
        fail(
            f"--repeats must be at least 2 to measure a spread, got {repeats}"
            if repeats < 2
            else f"--repeats must be at most {MAX_REPEATS}, got {repeats}"
        )
    try:
        current = load_protocol(protocol)
        spec = load_model_spec(model)
        family = get_family(spec.family)  # its baseline and workload are the defaults
        dev = load_workload(workload or family.workload).single_stream("orchestrate noise")
        base = load_stack(stack or family.baseline)
    except (ConfigError, StackError) as exc:
        fail(str(exc))
    store = open_store(db)
    try:
        store.register_protocol(current)  # edited in place under a recorded version: exit 2
    except proto.ProtocolError as exc:
        fail(str(exc))
    try:
        analysis = noise_mod.measure(
            store,
            stack=base,
            model=spec,
            dev=dev,
            protocol=current,
            repeats=repeats,
            runs_dir=runs_dir,
            track=mlflow,
            on_event=_events(as_json),
        )
    except (noise_mod.NoiseError, proto.ProtocolError, StackError, ScoringError) as exc:
        fail(str(exc), 1)
    try:
        new = noise_mod.propose(current, analysis, store.next_protocol_version(current))
    except noise_mod.TooNoisy as exc:  # nothing written; the numbers still shown
        if as_json:
            print_json({"runs": analysis.runs, "analysis": analysis.to_dict(), "protocol": None,
                        "refused": str(exc)})  # fmt: skip
        else:
            _noise_table(analysis, repeats, current.noise.max_aa_cv)
        fail(str(exc), EXIT_TOO_NOISY)
    # A new version gets its own file (configs/protocols/NAME-vN.yaml beside
    # configs/protocol.yaml): the tracked default is replaced only when --out names it.
    target = out or proto.version_path(new, proto.protocol_path(protocol))
    try:
        proto.write(new, target)
        store.register_protocol(new)
    except proto.ProtocolError as exc:
        fail(str(exc), 1)
    use = f"--protocol {_shown(target)}"
    summary = {
        "runs": analysis.runs,
        "analysis": analysis.to_dict(),
        "protocol": {
            "path": str(target),
            "version": new.version,
            "hash": new.content_hash(),
            "parent": current.content_hash(),
            "use": use,
        },
        "gates": [g.model_dump() for g in new.quality.gates],
        "min_speedup": new.speed.min_speedup,
        "min_speedup_derivation": analysis.min_speedup_derivation,
        "aa_cv": analysis.aa_cv,
        "max_aa_cv": current.noise.max_aa_cv,
    }
    if as_json:
        return print_json(summary)
    _noise_table(analysis, repeats, current.noise.max_aa_cv)
    console.print(
        f"wrote protocol {new.name} v{new.version} ({new.content_hash()}, parent "
        f"v{current.version}) to {_shown(target)}: min speedup {new.speed.min_speedup}, gates: "
        + "; ".join(g.describe() for g in new.quality.gates)
    )
    console.print(f"use it with {use} (gate, run, score, frontier, figures)")


def _shown(path: Path) -> str:
    """`path` relative to the working folder when under it (what a user would type)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _noise_table(analysis: Any, repeats: int, max_cv: float) -> None:
    """The spread of every metric, the A/A timing spread judged against max_aa_cv, and how
    min_speedup was derived, with the measured numbers."""
    table = Table(title=f"noise: {analysis.stack} vs {analysis.stack}.aa, {repeats} repeats")
    for col in ("metric", "per repeat", "sd", "max Δ", "tolerance", "rule"):
        table.add_column(col)
    for sp in [*analysis.speed.values(), *analysis.quality.values()]:
        table.add_row(
            sp.metric,
            ", ".join(f"{v:.4g}" for v in sp.values),
            f"{sp.sd:.3g}",
            f"{sp.max_pair_delta:.3g}",
            "" if sp.tolerance is None else f"{sp.tolerance:.4g}",
            sp.rule,
        )
    t = analysis.aa_timing
    if t is not None:
        table.add_row(
            t.metric, ", ".join(f"{v:.4g}" for v in t.values), f"{t.sd:.3g}",
            f"{t.max_pair_delta:.3g}", "", f"sd/mean {analysis.aa_cv:.1%} (max_aa_cv {max_cv:.1%})",
        )  # fmt: skip
    bounds = [term["bound"] for term in analysis.min_speedup_terms]
    table.add_row(
        "min_speedup", ", ".join("-" if b is None else f"{b:.4g}" for b in bounds), "", "",
        f"{analysis.min_speedup:g}", "max(1, max over repeats of max(CI high, 1/CI low))",
    )  # fmt: skip
    console.print(table)
    for c in analysis.aa:
        console.print(f"A/A speed: {c.reason()}")
    console.print(analysis.min_speedup_derivation)
    for note in analysis.notes:
        console.print(f"[yellow]{note}[/yellow]")


# -------------------------------------------------------------------------------- score


def score(
    run: Annotated[str | None, typer.Argument(help="Run id or prefix to score (in the DB).")] = (
        None
    ),
    result: Annotated[
        Path | None, typer.Option(help="Score this result JSON without a database.")
    ] = None,
    audio_dir: Annotated[
        Path | None, typer.Option(help="Folder the result's relative WAV paths are under.")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="With --result: score sheet JSON.")] = None,
    ingest: Annotated[Path | None, typer.Option(help="Store a score sheet made elsewhere.")] = None,
    protocol: ProtocolOpt = "protocol",
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Score saved recordings with the protocol's scorer set (here, or on another worker)."""
    from orchestrate.api.records import ResultRecord
    from orchestrate.api.scoring import ScoringError
    from orchestrate.research import scoring_run
    from orchestrate.store.store import StoreError

    try:
        current = load_protocol(protocol)
    except ConfigError as exc:
        fail(str(exc))
    if sum(x is not None for x in (run, result, ingest)) != 1:
        fail("give exactly one of: RUN, --result FILE (no database), --ingest SHEET")
    try:
        if result is not None:  # a scoring worker: no database, writes a sheet
            rec = ResultRecord.read(result)
            root = audio_dir or scoring_run.audio_root(rec, result)
            sheet = scoring_run.score_result(rec, current, root, on_event=_events(as_json))
            target = out or result.with_name(f"scores-{rec.job.job_id}.json")
            sheet.write(target)
            return _report_sheet(sheet, as_json, f"wrote {target}")
        store = open_store(db)
        store.register_protocol(current)
        if ingest is not None:
            sheet = scoring_run.ScoreSheet.model_validate_json(ingest.read_text())
            run_id = next(
                (r["id"] for r in store.list_runs(limit=100_000) if r["job_id"] == sheet.job_id),
                None,
            )
            if run_id is None:
                fail(f"no run of job {sheet.job_id} in the database; ingest its result first")
            added = scoring_run.store_sheet(store, run_id, sheet)
        else:
            sheet, added = scoring_run.score_run(
                store,
                run,
                current,
                audio_dir,
                on_event=_events(as_json),  # type: ignore[arg-type]
            )
            run_id = store.resolve(run)  # type: ignore[arg-type]
    except (ScoringError, StoreError, ValueError, LookupError, OSError) as exc:
        fail(str(exc), 1)
    rows = scoring_run.load_rows(store, run_id)
    quality = scoring_run.stack_quality(store.get_result(run_id), rows, current)
    if as_json:
        return print_json(
            {
                "run_id": run_id,
                "added": added,
                "quality": {k: vars(v) for k, v in quality.items()},
            }
        )
    _quality_table(f"scores of run {run_id[:8]} ({added} new rows)", quality)


def _report_sheet(sheet: Any, as_json: bool, message: str) -> None:
    if as_json:
        return print_json(sheet.model_dump(mode="json"))
    failures = sum(r.status != "ok" for r in sheet.rows)
    console.print(f"{message}: {len(sheet.rows)} scores, {failures} coverage failures")


def _quality_table(title: str, quality: dict[str, Any]) -> None:
    metrics = sorted({m for q in quality.values() for m in q.values})
    table = Table(title=title)
    table.add_column("stack")
    for m in metrics:
        table.add_column(m, justify="right")
    table.add_column("coverage failures", justify="right")
    for name, q in quality.items():
        cells = [f"{q.values[m]:.4g}" if m in q.values else "-" for m in metrics]
        table.add_row(name, *cells, str(q.coverage_failures))
    console.print(table)


# --------------------------------------------------------------------------------- gate


def gate(
    stack: Annotated[str, typer.Option("--stack", "-s", help="Candidate stack (name or YAML).")],
    model: ModelOpt = "tiny",
    workload: WorkloadOpt = None,
    protocol: ProtocolOpt = "protocol",
    holdout: Annotated[
        Path | None, typer.Option(help="Sealed holdout file (default configs/holdout/NAME.yaml).")
    ] = None,
    allow_holdout_reuse: Annotated[
        bool, typer.Option(help="Accept even if this stack (or its lineage) saw the holdout.")
    ] = False,
    mlflow: Annotated[bool, typer.Option(help="Log runs and the champion alias to MLflow.")] = (
        True
    ),
    runs_dir: RunsDirOpt = Path("runs"),
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Phase gate: fresh remeasure, then the sealed holdout; accept (champion) or retain."""
    from orchestrate.api.scoring import ScoringError
    from orchestrate.research.holdout import HoldoutError
    from orchestrate.running.runner import Interrupted

    try:
        current = load_protocol(protocol)
        spec, cand = load_model_spec(model), load_stack(stack)
        dev = load_workload(workload or get_family(spec.family).workload)
        dev.single_stream("orchestrate gate")
    except (ConfigError, StackError) as exc:
        fail(str(exc))
    store = open_store(db)
    try:
        report = gate_pipeline.run_gate(
            store,
            candidate=cand,
            model=spec,
            dev=dev,
            protocol=current,
            runs_dir=runs_dir,
            track=mlflow,
            allow_reuse=allow_holdout_reuse,
            holdout_file=holdout,
            on_event=_events(as_json),
        )
    except HoldoutLeak as exc:  # a holdout text in the dev workload: refused, and audited
        audit_refusal(store, exc, "orchestrate gate")
        fail(str(exc))
    except (proto.ProtocolError, HoldoutError, StackError) as exc:
        fail(str(exc))
    except ScoringError as exc:  # a scorer of the protocol cannot load here
        fail(f"scoring failed: {exc}", 1)
    except (KeyboardInterrupt, Interrupted) as exc:
        fail(f"interrupted; runs are marked INTERRUPTED and the holdout audit closed ({exc})", 130)
    v = report.get("verdict", {})
    if as_json:
        print_json(report)
    else:
        _gate_summary(report, v, current.speed.confidence)
    if v.get("verdict") != "accept":  # scripts tell a retain from an accept by the status
        raise typer.Exit(EXIT_RETAIN)


def _gate_summary(report: dict[str, Any], v: dict[str, Any], confidence: float) -> None:
    from orchestrate.reports.tables import headline_cell

    color = "green" if v.get("verdict") == "accept" else "yellow"
    console.print(
        f"[{color}]{v.get('verdict', '?').upper()}[/{color}] {report['candidate']} vs "
        f"{report['against']} on {report['workload']} ({report['hardware']}), "
        f"protocol {report['protocol']}"
    )
    # Stored numbers, labelled by the run they come from: the decision's own (a champion's
    # is its holdout's: what ledger, frontier and MLflow carry), then the remeasure's.
    rec, h = report.get("record") or {}, report.get("headline") or {}
    decided, label = rec.get("headline") or {}, headline_label(confidence)
    if decided:
        role = "the champion's headline" if v.get("verdict") == "accept" else "decided on"
        console.print(f"  {label} vs stock, {decided['label']} ({role}): {headline_cell(decided)}")
    agg = f"{AGGREGATE_LABEL} {h[AGGREGATE]:.2f}x" if AGGREGATE in h else ""
    if h and decided.get("label") != "remeasure paired":
        cells = "; ".join(filter(None, [headline_cell(h), agg]))
        console.print(f"  {label} vs stock, remeasure paired: {cells}")
    elif agg:
        console.print(f"  remeasure {agg}")
    for reason in v.get("reasons", []):
        console.print(f"  - {reason}")
    if "vs_stock" in report:
        console.print(f"  vs stock: {report['vs_stock']}")
    for flag in v.get("overridden", []):
        console.print(f"  [yellow]overridden[/yellow]: {flag}")
    if rec.get("mlflow_model"):
        console.print(f"  champion: {rec['mlflow_model']}")
    if rec.get("mlflow_warning"):
        err.print(f"[yellow]warning: {rec['mlflow_warning']}; the decision is recorded[/yellow]")


# ------------------------------------------------------------------------------ reports


def ledger(
    cause: Annotated[
        str | None,
        typer.Option(help="Only this cause (slower, below the noise bar, gate, oom, killed, ...)."),
    ] = None,
    stack: Annotated[str | None, typer.Option(help="Only this stack.")] = None,
    limit: int = 1000,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Markdown ledger, always the full ledger (default: ledger.md in the "
            "database's reports folder, e.g. orchestrate-reports/ beside orchestrate.db)."
        ),
    ] = None,
    write: Annotated[bool, typer.Option(help="Write the markdown ledger.")] = True,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Failure ledger: every rejected or failed stack with its cause."""
    from orchestrate.reports import ledger as ledger_mod

    store = open_store(db)
    out = out or output_dir(db) / "ledger.md"
    rows = ledger_mod.entries(store, cause=cause, stack=stack, limit=limit)
    if write:
        ledger_mod.write(store, out)
    if as_json:
        return print_json(rows)
    table = ReadableTable(title="failure ledger" + (f" (written to {out})" if write else ""))
    for col in ("when", "stack", "cause", "workload", "protocol", "run", "detail"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            f"{r['created_at']:%Y-%m-%d %H:%M}",
            r["stack_name"] or "(run)",
            r["cause"],
            r["workload"] or "",
            f"v{r['protocol_version']}" if r["protocol_version"] else "",
            (r["run_id"] or "")[:8] + (" (noisy)" if r["noisy"] else ""),
            r["detail"],  # whole: the reason is what a reader came for
        )
    console.print(table)
    for c in ledger_mod.champion_rows(store):  # each accept's holdout paired headline
        notes = [f"overridden: {o}" for o in c["overridden"]]
        if c["quality"] != "judged":
            notes.append(f"quality {c['quality']}")
        console.print(
            f"champion {c['stack_name']} ({c['workload_name']}, {c['hardware']}): "
            f"{headline_label()} vs stock {c['headline']}" + "".join(f"; {n}" for n in notes)
        )


def frontier(
    workload: LastWorkloadOpt = None,
    model: Annotated[
        str | None, typer.Option(help="Model preset (default: that of the newest run).")
    ] = None,
    hardware: Annotated[str | None, typer.Option(help="Default: the newest run's.")] = None,
    metric: Annotated[str | None, typer.Option(help="Quality axis of the Pareto set.")] = None,
    protocol: ProtocolOpt = "protocol",
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Best gated speedup (holdout paired) over experiments, dev-only stacks apart, and the
    speed-quality Pareto set."""
    from orchestrate.reports.frontier import collect
    from orchestrate.research.decide import NOT_MEANINGFUL

    try:
        current = load_protocol(protocol)
        spec = load_model_spec(model) if model else None
        store = open_store(db)
        name = load_workload(workload).name if workload else last_workload(store)
        data = collect(store, current, name, spec, hardware, metric)
    except (ConfigError, proto.ProtocolError) as exc:
        fail(str(exc))
    if as_json:
        return print_json(data.to_dict())
    table = ReadableTable(title=f"experiments · {data.workload} · {data.model} · {data.hardware}")
    headers = ("#", "phase", "stack", headline_label(current.speed.confidence), AGGREGATE_LABEL)
    for col in (*headers, "exact", "gate", "status", "why"):
        table.add_column(col)
    steps = {s["index"]: " ◀ frontier" for s in data.frontier}
    steps |= {s["index"]: " ◀ dev only" for s in data.dev_only}
    for p in data.points:
        table.add_row(
            str(p.index),
            p.phase,
            p.stack,
            _step_cell(p.speedup, p.ci_low, p.ci_high) + steps.get(p.index, ""),
            "-" if p.rtf_ratio is None else f"{p.rtf_ratio:.2f}x",
            EXACT_CELL[p.exactness],
            p.gate,
            p.status + (" · noisy" if p.noisy else ""),
            "; ".join(p.reasons),  # whole: why a stack was retained must be readable
        )
    console.print(table)
    # The best is what the gate accepted, at its holdout paired estimate; what was never
    # gated is shown apart, labelled, and is not a result until it is.
    best = data.frontier[-1] if data.frontier else None
    if best:
        over = "".join(f"; overridden: {o}" for o in best["overridden"])
        console.print(
            f"best gated: {_step_cell(best['speedup'], best['ci_low'], best['ci_high'])} "
            f"{best['label']} ({best['stack']}){over}"
        )
    else:
        console.print("no gated stack beats stock yet")
    if data.dev_only:
        dev = data.dev_only[-1]
        console.print(
            f"{dev['label']}: best {_step_cell(dev['speedup'], dev['ci_low'], dev['ci_high'])} "
            f"paired ({dev['stack']})"
        )
    if data.points and all(p.quality == NOT_MEANINGFUL for p in data.points):
        console.print(f"Pareto set: none, quality {NOT_MEANINGFUL}")
    else:
        console.print(
            f"Pareto set (speedup vs Δ{data.pareto_metric}): "
            + ", ".join(f"{c['stack']} {c['speedup']:.2f}x Δ{c['delta']:+.3g}" for c in data.pareto)
        )
    if data.excluded:
        console.print(f"[dim]not shown: {escape(_excluded_line(data.excluded))}[/dim]")


def _excluded_line(excluded: dict[str, int]) -> str:
    """`3 runs: protocol 55214bd2 (v2); 1 run: run did not finish` (why runs are left out)."""
    return "; ".join(f"{n} run{'s' * (n != 1)}: {why}" for why, n in excluded.items())


def _step_cell(speedup: float, lo: float | None, hi: float | None) -> str:
    """A stored headline as show prints it (reports.tables.headline_cell)."""
    from orchestrate.reports.tables import headline_cell

    stored = {"speedup_paired": speedup}
    if lo is not None and hi is not None:
        stored |= {"speedup_paired_lo": lo, "speedup_paired_hi": hi}
    return headline_cell(stored)


def figures(
    workload: LastWorkloadOpt = None,
    model: Annotated[str | None, typer.Option(help="Default: the newest run's model.")] = None,
    hardware: Annotated[str | None, typer.Option(help="Default: the newest run's.")] = None,
    run: Annotated[
        str | None, typer.Option(help="Run for the quality screen (default: latest holdout).")
    ] = None,
    ladder_run: Annotated[
        str | None, typer.Option(help="Run for the ladder (default: the workload's newest).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Output folder (default: figures/ in the database's reports folder)."),
    ] = None,
    protocol: ProtocolOpt = "protocol",
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Draw frontier, Pareto, quality screen, holdout-delta, ladder and throughput figures."""
    from orchestrate.reports.figures import render_all

    try:
        current = load_protocol(protocol)
        spec = load_model_spec(model) if model else None
        store = open_store(db)
        name = load_workload(workload).name if workload else last_workload(store)
        out = out or output_dir(db) / "figures"
        manifest = render_all(
            store,
            current,
            name,
            out,
            spec,
            hardware,
            store.resolve(run) if run else None,
            store.resolve(ladder_run) if ladder_run else None,
        )
    except (ConfigError, proto.ProtocolError, LookupError) as exc:
        fail(str(exc))
    if as_json:
        return print_json(manifest)
    for fig in manifest["figures"]:
        console.print(f"wrote {out / fig}")
    for fig, why in manifest["skipped"].items():
        console.print(f"[yellow]skipped {fig}: {why}[/yellow]")


def register(app: typer.Typer) -> None:
    for command in (noise, score, gate, ledger, frontier, figures):
        app.command()(command)
