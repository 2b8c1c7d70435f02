"""`orchestrate`: run stacks, inspect techniques and stacks, browse and ingest results."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrate.api.config import (
    ConfigError,
    ModelSpec,
    StackSpec,
    Workload,
    load_model_spec,
    load_stack,
    load_workload,
)
from orchestrate.api.protocol import Protocol, load_protocol
from orchestrate.api.registry import StackError, get_family
from orchestrate.cli.common import DbOpt, JsonOpt, console, err, fail, open_store, print_json

SCHEMAS: dict[str, type[BaseModel]] = {
    "model": ModelSpec,
    "workload": Workload,
    "stack": StackSpec,
    "protocol": Protocol,
}

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Experiment orchestration for TTS inference speed-ups.",
)


@app.command()
def run(
    stack: Annotated[
        list[str],
        typer.Option("--stack", "-s", help="Stack name (experiments/) or YAML path; repeatable."),
    ],
    baseline: Annotated[
        str | None,
        typer.Option(help="Stack every other stack is compared against (default: the family's)."),
    ] = None,
    model: Annotated[
        str, typer.Option(help="Model preset (configs/models/) or a local weights folder.")
    ] = "tiny",
    workload: Annotated[
        str | None,
        typer.Option(help="Workload name (configs/workloads/) or YAML path (default: family's)."),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: the model preset's).")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    strict: Annotated[
        bool, typer.Option(help="Refuse techniques this device lacks instead of skipping them.")
    ] = False,
    prefixes: Annotated[
        bool, typer.Option(help="Also run every cumulative prefix of each --stack.")
    ] = False,
    force: Annotated[
        bool, typer.Option(help="Re-run even if this exact experiment already finished.")
    ] = False,
    fidelity_steps: Annotated[
        int, typer.Option(help="Teacher-forced steps compared against stock (0: off).")
    ] = 32,
    mlflow: Annotated[bool, typer.Option(help="Log to MLflow as well as the database.")] = True,
    runs_dir: Annotated[
        Path, typer.Option(help="Where jobs, results and WAVs are written.")
    ] = Path("runs"),
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure stacks against a baseline, interleaved, in one worker; store and report."""
    from orchestrate.running.plan import plan_job, prefix_stack
    from orchestrate.running.runner import Interrupted, execute

    try:
        if device not in (None, "cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, not {device!r}")
        spec = load_model_spec(model, device=device, dtype=dtype)
        family = get_family(spec.family)
        baseline, workload = baseline or family.baseline, workload or family.workload
        stacks = [load_stack(baseline)]
        for name in stack:
            candidate = load_stack(name)
            if prefixes:
                stacks += [prefix_stack(candidate, n) for n in range(1, len(candidate.techniques))]
            if candidate.name != stacks[0].name:
                stacks.append(candidate)
        job = plan_job(
            spec,
            load_workload(workload),
            stacks,
            load_protocol(),
            runs_dir,
            strict=strict,
            fidelity_steps=fidelity_steps,
        )
    except (ConfigError, StackError, ValueError) as exc:
        fail(str(exc))
    store = open_store(db)
    try:
        with _progress(quiet=as_json) as on_event:
            outcome = execute(job, store, runs_dir, track=mlflow, force=force, on_event=on_event)
    except (KeyboardInterrupt, Interrupted) as exc:
        fail(f"interrupted; the run is marked INTERRUPTED ({exc})", 130)
    if outcome.reused:
        msg = f"identical experiment already recorded as run {outcome.run_id}; --force re-runs it"
        print_json({"run_id": outcome.run_id, "reused": True}) if as_json else console.print(msg)
        return
    if outcome.error:
        fail(f"run {outcome.run_id} failed: {outcome.error}", 1)
    if as_json:
        print_json(store.get_run(outcome.run_id))
    else:
        _show(store.get_run(outcome.run_id))
    if outcome.status == "failed":
        raise typer.Exit(1)


class _progress:
    """Progress bar fed by the worker's JSON-line events."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        )
        self.task = self.bar.add_task("starting worker", total=None)

    def __enter__(self) -> Any:
        if not self.quiet:
            self.bar.start()
        return self.on_event

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.bar.stop()

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("event") == "progress":
            self.bar.update(
                self.task,
                completed=event["done"],
                total=event["total"],
                description=f"timing {event['stack']}",
            )
        elif event.get("event") == "status":
            self.bar.update(self.task, description=event["message"])


@app.command()
def worker(
    job: Annotated[Path, typer.Argument(help="Job JSON written by the orchestrator.")],
    out: Annotated[Path | None, typer.Option(help="Result JSON path.")] = None,
) -> None:
    """Run one job by hand (e.g. on a GPU host) and write its result JSON."""
    from orchestrate.running.worker import main

    raise typer.Exit(main([str(job)] + (["--out", str(out)] if out else [])))


@app.command()
def ingest(
    result: Annotated[Path, typer.Argument(help="Result JSON produced by `orchestrate worker`.")],
    mlflow: Annotated[bool, typer.Option(help="Log to MLflow as well.")] = True,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Record a result produced elsewhere."""
    from pydantic import ValidationError

    from orchestrate.running.runner import ingest as do_ingest
    from orchestrate.store.store import StoreError

    if not result.exists():
        fail(f"{result}: no such file")
    store = open_store(db)
    try:
        outcome = do_ingest(result, store, track=mlflow)
    except ValidationError as exc:
        fail(
            f"{result}: not a valid result record: {exc.error_count()} problems, first: "
            f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        )
    except (ValueError, StoreError) as exc:
        fail(str(exc))
    if as_json:
        print_json(store.get_run(outcome.run_id))
    else:
        _show(store.get_run(outcome.run_id))


@app.command()
def runs(limit: int = 20, db: DbOpt = None, as_json: JsonOpt = False) -> None:
    """Recent runs."""
    rows = open_store(db).list_runs(limit=limit)
    if as_json:
        return print_json(rows)
    table = Table(title="runs")
    for col in ("id", "status", "started", "model", "workload", "stacks", "error"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["id"][:12],
            r["status"],
            str(r["started_at"])[:19],
            str(r.get("model", "")),
            r.get("workload_name", ""),
            ", ".join(r.get("stacks", [])),
            (r.get("error") or "")[:60],
        )
    console.print(table)


@app.command()
def show(
    run_id: Annotated[str, typer.Argument(help="Run id or unique prefix.")],
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Metrics of one run, each stack against the baseline."""
    try:
        run_row = open_store(db).get_run(run_id)
    except (KeyError, LookupError, ValueError) as exc:
        fail(str(exc))
    print_json(run_row) if as_json else _show(run_row)


def _show(run_row: dict[str, Any]) -> None:
    from orchestrate.reports.tables import stack_table

    title = (
        f"run {run_row['id'][:12]} · {run_row['status']} · {run_row.get('workload_name')} · "
        f"{(run_row.get('environment') or {}).get('device_name', '')}"
    )
    console.print(stack_table(title, run_row["stacks"]))
    for s in run_row["stacks"]:
        if s.get("error"):
            console.print(f"[red]{s['name']}: {s['error']}[/red]")
        fid = s.get("fidelity")
        if fid and (s["position"] > 0 or s.get("applied")):  # stock vs itself says nothing
            verdict = "within tolerance" if fid["within_tolerance"] else "OUTSIDE tolerance"
            console.print(
                f"{s['name']}: fidelity vs stock over {fid['steps']} steps: {verdict}; "
                f"mean KL {fid['mean_kl']:.3g}, top-1 {fid['top1_agreement']:.3f}, "
                f"top-k overlap {fid['topk_agreement']:.3f}"
                + (
                    f"; over its own columns: KL {fid['support_kl']:.3g}, "
                    f"top-1 {fid['support_top1']:.3f}"
                    if fid.get("support_kl") is not None
                    and abs(fid["support_kl"] - fid["mean_kl"]) > 1e-9
                    else ""
                )
            )


@app.command()
def diff(
    run_a: Annotated[str, typer.Argument(help="Run id or unique prefix (the reference).")],
    run_b: Annotated[str, typer.Argument(help="Run id or unique prefix (compared with a).")],
    threshold: Annotated[
        float, typer.Option(min=0.0, help="Relative change below which a number counts as equal.")
    ] = 0.02,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Only what differs between two runs: settings, environment, stacks and metrics."""
    from orchestrate.reports.run_diff import diff_runs
    from orchestrate.reports.tables import run_diff_tables

    try:
        store = open_store(db)
        result = diff_runs(
            store.get_run(run_a, utterances=False), store.get_run(run_b, utterances=False),
            threshold,
        )  # fmt: skip
    except (KeyError, LookupError, ValueError) as exc:
        fail(str(exc))
    if as_json:
        return print_json(result.to_json())
    for table in run_diff_tables(result):
        console.print(table)


@app.command()
def schema(
    name: Annotated[str | None, typer.Argument(help=f"One of {sorted(SCHEMAS)}.")] = None,
) -> None:
    """JSON schema of the config files (all of them without a name)."""
    if name and name not in SCHEMAS:
        fail(f"unknown schema {name!r}; known: {', '.join(sorted(SCHEMAS))}")
    names = [name] if name else sorted(SCHEMAS)
    print_json({n: SCHEMAS[n].model_json_schema() for n in names})


from orchestrate.cli import plugins as plugins_cli  # noqa: E402
from orchestrate.cli import protocol as protocol_cli  # noqa: E402

plugins_cli.register(app)
protocol_cli.register(app)

