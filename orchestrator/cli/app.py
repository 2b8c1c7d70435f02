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
    explain,
    load_model_spec,
    load_stack,
    load_workload,
    stack_path,
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
    from pydantic import ValidationError

    from orchestrate.reports.tables import error_line
    from orchestrate.running.plan import plan_job, prefix_stack
    from orchestrate.running.runner import Interrupted, execute

    try:
        _check_options(device=device, dtype=dtype, fidelity_steps=fidelity_steps)
        spec = load_model_spec(model, device=device, dtype=dtype)
        family = get_family(spec.family)
        baseline, workload = baseline or family.baseline, workload or family.workload
        stacks = [load_stack(baseline)]
        for name in stack:
            candidate = load_stack(name)
            is_baseline = candidate.name == stacks[0].name
            if is_baseline:  # the baseline listed again is measured once, as the baseline
                _same_as_baseline(candidate, name, stacks[0], baseline)
            if prefixes:
                stacks += [prefix_stack(candidate, n) for n in range(1, len(candidate.techniques))]
            if not is_baseline:
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
    except ValidationError as exc:  # a ValueError too: never show pydantic's text and URLs
        fail(explain(exc))
    except (ConfigError, StackError, ValueError) as exc:
        fail(str(exc))
    store = open_store(db)
    try:
        with _progress(quiet=as_json) as on_event:
            outcome = execute(job, store, runs_dir, track=mlflow, force=force, on_event=on_event)
    except (KeyboardInterrupt, Interrupted) as exc:
        why = str(exc) or "Ctrl-C"  # a KeyboardInterrupt has no message
        fail(f"interrupted ({why}); the run is marked INTERRUPTED", 130)
    if outcome.reused:
        msg = f"identical experiment already recorded as run {outcome.run_id}; --force re-runs it"
        print_json({"run_id": outcome.run_id, "reused": True}) if as_json else console.print(msg)
        return
    if outcome.error:  # one line (it names the worker log); the whole output stays there
        fail(f"run {outcome.run_id[:12]} failed: {error_line(outcome.error)}", 1)
    if as_json:
        print_json(store.get_run(outcome.run_id))
    else:
        _show(store.get_run(outcome.run_id))
    if outcome.status == "failed":
        raise typer.Exit(1)


DTYPES = ("float32", "bfloat16", "float16")


def _check_options(device: str | None, dtype: str | None, fidelity_steps: int) -> None:
    """Options checked here, in the CLI's words, before they reach a pydantic model."""
    if device not in (None, "cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {device!r}")
    if dtype not in (None, *DTYPES):
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fidelity_steps < 0:
        raise ConfigError(f"--fidelity-steps must be >= 0, got {fidelity_steps}")


def _same_as_baseline(candidate: StackSpec, name: str, base: StackSpec, base_name: str) -> None:
    """A --stack named like the baseline is the baseline only if it applies the same
    techniques; otherwise one of them would be dropped without a word."""
    if (candidate.family, candidate.techniques) != (base.family, base.techniques):
        raise ConfigError(
            f"stack {candidate.name!r} from {stack_path(name)} has the baseline's name but "
            f"other techniques than the baseline {base.name!r} from {stack_path(base_name)}; "
            "rename one of them"
        )


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
    from pydantic import ValidationError

    from orchestrate.api.records import JobSpec
    from orchestrate.running.worker import main

    if not job.is_file():
        fail(f"no such file: {job}")
    try:  # read here first so a bad file is one line, not the worker's traceback
        JobSpec.model_validate_json(job.read_text())
    except ValidationError as exc:
        fail(f"{job}: not a valid job: {explain(exc)}")
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
def runs(
    limit: Annotated[int, typer.Option(help="How many runs, newest first.")] = 20,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Recent runs."""
    from orchestrate.reports.tables import error_line

    if limit < 1:
        fail(f"--limit must be >= 1, got {limit}")
    rows = open_store(db).list_runs(limit=limit)
    if as_json:
        return print_json(rows)
    table = Table(title="runs")
    for col in ("id", "status", "started", "model", "workload", "stacks"):
        table.add_column(col)
    table.add_column("error", no_wrap=True, overflow="ellipsis")  # one row per run
    for r in rows:
        table.add_row(
            r["id"][:12],
            r["status"],
            str(r["started_at"])[:19],
            str(r.get("model", "")),
            r.get("workload_name", ""),
            ", ".join(r.get("stacks", [])),
            error_line(r.get("error"), width=80),
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
    from rich.markup import escape

    from orchestrate.reports.tables import error_line, skipped_lines, stack_table

    title = (
        f"run {run_row['id'][:12]} · {run_row['status']} · {run_row.get('workload_name')} · "
        f"{(run_row.get('environment') or {}).get('device_name', '')}"
    )
    if run_row.get("error"):  # a failed or interrupted run: say why under the title
        console.print(escape(title), style="bold", highlight=False)
        console.print(f"[red]error: {escape(error_line(run_row['error']))}[/red]", soft_wrap=True)
        if len(run_row["error"].splitlines()) > 1:
            console.print(f"[dim]full text: orchestrate show {run_row['id'][:12]} --json[/dim]")
    if run_row["stacks"]:
        console.print(stack_table(None if run_row.get("error") else title, run_row["stacks"]))
    for line in skipped_lines(run_row["stacks"]):  # soft_wrap: one line each, however long
        console.print(escape(line), highlight=False, soft_wrap=True)
    for s in run_row["stacks"]:
        if s.get("error"):
            console.print(f"[red]{escape(s['name'])}: {escape(s['error'])}[/red]")
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
        float, typer.Option(help="Relative change below which a number counts as equal.")
    ] = 0.02,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Only what differs between two runs: settings, environment, stacks and metrics."""
    from orchestrate.reports.run_diff import diff_runs
    from orchestrate.reports.tables import run_diff_tables

    if not threshold >= 0:  # one line in the CLI's words, not typer's boxed range error
        fail(f"--threshold must be >= 0, got {threshold}")
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


from orchestrate.cli import faults as faults_cli  # noqa: E402
from orchestrate.cli import plugins as plugins_cli  # noqa: E402
from orchestrate.cli import protocol as protocol_cli  # noqa: E402

plugins_cli.register(app)
protocol_cli.register(app)
faults_cli.register(app)  # last: it wraps every command registered before it

