"""`orchestrate`: run stacks, inspect techniques and stacks, browse and ingest results."""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from orchestrate.api.config import (
    ModelSpec,
    StackSpec,
    Workload,
    explain,
)
from orchestrate.api.protocol import Protocol
from orchestrate.cli.common import (
    DbOpt,
    JsonOpt,
    ProtocolOpt,
    console,
    err,
    fail,
    open_store,
    print_json,
    warn,
)
from orchestrate.cli.planning import (
    BaselineOpt,
    DeviceOpt,
    DtypeOpt,
    FidelityOpt,
    ForceOpt,
    ModelOpt,
    PrefixesOpt,
    StackOpt,
    StrictOpt,
    WorkloadOpt,
)

SCHEMAS: dict[str, type[BaseModel]] = {
    "model": ModelSpec,
    "workload": Workload,
    "stack": StackSpec,
    "protocol": Protocol,
}


# Help piped into a pager, a file or an agent is plain click text: rich's boxed panels cut
# option names and defaults to fit (`--allow-holdout-r…`), and a pipe has no width to
# stretch them into. Plain help wraps between words, and not at hyphens, so a default such
# as `no-allow-holdout-reuse` stays whole on its line.
def _help_wraps_whole_words() -> None:
    """Plain help wraps between words only: click's wrapper (typer's vendored copy where
    there is one) is told not to break at hyphens, which click never asks for."""
    try:
        from typer._click import _textwrap as wrap  # typer >= 0.20 vendors click
    except ImportError:
        from click import _textwrap as wrap  # type: ignore[no-redef]

    class WholeWords(wrap.TextWrapper):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.break_on_hyphens = False

    wrap.TextWrapper = WholeWords  # read at each wrap_text call


_help_wraps_whole_words()
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Experiment orchestration for TTS inference speed-ups.",
    rich_markup_mode="rich" if sys.stdout.isatty() else None,
)


def _version(value: bool) -> None:
    """`--version`: the package version, and the commit when this is a checkout."""
    if not value:
        return
    from importlib.metadata import version

    from orchestrate.running.environment import code_state

    state = code_state(with_diff=False)  # ORCHESTRATE_CODE_SHA, else git; None: unknown
    commit = "git commit unknown" if not state.sha else f"git {state.sha[:12]}"
    commit += ", modified" if state.dirty else ""
    console.print(f"orchestrate {version('orchestrate')} ({commit})", highlight=False)
    raise typer.Exit()


@app.callback()
def _main(
    show_version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Version and commit."),
    ] = False,
) -> None:
    """Experiment orchestration for TTS inference speed-ups."""


@app.command()
def run(
    stack: StackOpt = None,
    baseline: BaselineOpt = None,
    model: ModelOpt = "tiny",
    workload: WorkloadOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    strict: StrictOpt = False,
    prefixes: PrefixesOpt = False,
    force: ForceOpt = False,
    fidelity_steps: FidelityOpt = 32,
    protocol: ProtocolOpt = "protocol",
    mlflow: Annotated[bool, typer.Option(help="Log to MLflow as well as the database.")] = True,
    runs_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where jobs, results and WAVs are written (default: runs; with --resume, "
            "beside the resumed run's folder)."
        ),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue an INTERRUPTED or FAILED run (id or prefix) from the utterances it "
            "measured, as a new run; takes no other job options."
        ),
    ] = None,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Measure stacks against a baseline, interleaved, in one worker; store and report.

    The job goes through the queue: a live pool (`orchestrate workers`) runs it, else this
    process does."""
    from orchestrate.cli.planning import plan_cli_job
    from orchestrate.reports.tables import error_line
    from orchestrate.running.executor import PoolExecutor, Submission, executor_for, submit
    from orchestrate.running.runner import Interrupted

    if resume is not None:
        given = locals()
        job_options = {k: given[k] for k in _JOB_OPTIONS}
        return _resume_run(resume, job_options, runs_dir, mlflow, db, as_json)
    runs_dir = runs_dir or Path("runs")
    job, store = plan_cli_job(
        stack, baseline, model, workload, device, dtype, strict, prefixes, fidelity_steps,
        protocol, runs_dir, db, "orchestrate run",
    )  # fmt: skip
    subs = [Submission(job, force=force)]
    try:
        with _progress(quiet=as_json) as on_event:
            executor = executor_for(
                store, runs_dir, subs, track=mlflow, on_event=on_event, warm=False
            )
            if not as_json and isinstance(executor, PoolExecutor):
                console.print(f"job {job.job_id} queued for the worker pool")
            try:
                (outcome,) = submit(executor, subs)
            finally:
                executor.close()
    except (KeyboardInterrupt, Interrupted) as exc:
        _interrupted(exc)
    from orchestrate.reports.tables import annotate

    if outcome.reused:
        msg = f"identical experiment already recorded as run {outcome.run_id}; --force re-runs it"
        print_json({"run_id": outcome.run_id, "reused": True}) if as_json else console.print(msg)
        if strict:  # the recorded run answers for --strict as a fresh one would
            _strict_exactness(annotate(store.get_run(outcome.run_id, utterances=False)))
        return
    if outcome.error:  # one line (it names the worker log); the whole output stays there
        fail(f"run {outcome.run_id[:12]} failed: {error_line(outcome.error)}", 1)
    run_row = annotate(store.get_run(outcome.run_id))
    print_json(run_row) if as_json else _show(run_row)
    if outcome.status == "failed":
        raise typer.Exit(1)
    _crashed_stacks(run_row)
    if strict:
        _strict_exactness(run_row)


EXIT_NOT_EXACT = 3  # `run --strict`: a stack declared exact measured outside tolerance
EXIT_STACK_FAILED = 5  # `run`: the run is recorded (PARTIAL), but a stack crashed in it


def _crashed_stacks(run_row: dict[str, Any]) -> None:
    """A run left PARTIAL because a stack crashed is not a success: exit EXIT_STACK_FAILED,
    naming the stacks (a stack skipped for this device is no crash: it exits 0)."""
    crashed = [s["name"] for s in run_row["stacks"] if s.get("status") == "failed"]
    if crashed:
        fail(
            f"run {run_row['id'][:12]} is {run_row['status']}: stack {', '.join(crashed)} "
            "failed while it ran (its error is above); the other stacks are recorded",
            EXIT_STACK_FAILED,
        )


def _strict_exactness(run_row: dict[str, Any]) -> None:
    """--strict holds exact claims to their measurement: exit EXIT_NOT_EXACT, naming them."""
    failed = [s["name"] for s in run_row["stacks"] if s.get("exactness") == "failed"]
    if failed:
        fail(
            f"--strict: {', '.join(failed)} declared exact but measured outside fidelity "
            f"tolerance (exactness failed)",
            EXIT_NOT_EXACT,
        )


# `run`'s options that define a job (and their defaults): --resume re-runs a recorded job,
# so none of them may be given with it.
_JOB_OPTIONS = {
    "stack": None, "baseline": None, "model": "tiny", "workload": None, "device": None,
    "dtype": None, "strict": False, "prefixes": False, "force": False, "fidelity_steps": 32,
    "protocol": "protocol",
}  # fmt: skip


def _interrupted(exc: BaseException) -> NoReturn:
    why = str(exc) or "Ctrl-C"  # a KeyboardInterrupt has no message
    fail(f"interrupted ({why}); the run is marked INTERRUPTED", 130)


def _resume_run(
    ref: str,
    job_options: dict[str, Any],
    runs_dir: Path | None,
    mlflow: bool,
    db: str | None,
    as_json: bool,
) -> None:
    """`run --resume RUN`: the recorded job again, in a new run that keeps what RUN measured
    (runner.plan_resume); refused with one line (exit 2) when that would mix measurements."""
    from orchestrate.running.runner import ResumeRefused, plan_resume
    from orchestrate.store.errors import ResumeClaimed, RunNotFound

    given = [k for k, default in _JOB_OPTIONS.items() if job_options[k] not in (default, [])]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        fail(f"--resume re-runs the recorded job as it was; drop {flags}")
    store = open_store(db)
    try:
        job, old_folder = plan_resume(store, ref)
    except (ResumeRefused, RunNotFound) as exc:
        fail(str(exc))
    try:
        _measure_resume(store, job, runs_dir or old_folder.parent, old_folder, mlflow, as_json)
    except ResumeClaimed as exc:  # another resume began first: its folder is not ours
        shutil.rmtree((runs_dir or old_folder.parent) / job.job_id, ignore_errors=True)
        fail(str(exc))


def _measure_resume(
    store: Any, job: Any, runs_dir: Path, old_folder: Path, mlflow: bool, as_json: bool
) -> None:
    from orchestrate.reports.tables import annotate, error_line
    from orchestrate.running.executor import LocalExecutor, Submission, submit
    from orchestrate.running.runner import Interrupted

    try:
        with _progress(quiet=as_json) as on_event:
            # Here, not on a pool: the carried utterances were timed on this host's device.
            executor = LocalExecutor(store, runs_dir, track=mlflow, on_event=on_event, warm=False)
            sub = Submission(job, force=True, recordings_from=old_folder)
            try:
                (outcome,) = submit(executor, [sub])
            finally:
                executor.close()
    except (KeyboardInterrupt, Interrupted) as exc:
        _interrupted(exc)
    if outcome.error:
        fail(f"run {outcome.run_id[:12]} failed: {error_line(outcome.error)}", 1)
    run_row = annotate(store.get_run(outcome.run_id))
    carried = sum(len(u) for u in job.carried.values())
    if not as_json:
        console.print(
            f"run {outcome.run_id[:12]} resumes run {str(job.resumed_from)[:12]}: {carried} "
            "utterances carried over, warm-up and fidelity redone"
        )
    print_json(run_row) if as_json else _show(run_row)
    if outcome.status == "failed":
        raise typer.Exit(1)
    _crashed_stacks(run_row)


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
    from orchestrate.reports.tables import annotate

    print_json(annotate(run_row)) if as_json else _show(run_row)


def _show(run_row: dict[str, Any]) -> None:
    from rich.markup import escape

    from orchestrate.reports.tables import (
        annotate,
        environment_line,
        error_line,
        fidelity_scope,
        fidelity_verdict,
        skipped_lines,
        slot_checks_line,
        stack_table,
    )

    run_row = annotate(run_row)
    title = (
        f"run {run_row['id'][:12]} · {run_row['status']} · {run_row.get('workload_name')} · "
        f"{(run_row.get('environment') or {}).get('device_name', '')}"
    ) + (" · NOISY" if run_row["noisy"] else "")
    protocol = (run_row.get("job") or {}).get("protocol") or {}
    confidence = (protocol.get("speed") or {}).get("confidence", 0.95)
    if run_row.get("error"):  # a failed or interrupted run: say why under the title
        console.print(escape(title), style="bold", highlight=False)
        console.print(f"[red]error: {escape(error_line(run_row['error']))}[/red]", soft_wrap=True)
        if len(run_row["error"].splitlines()) > 1:
            console.print(f"[dim]full text: orchestrate show {run_row['id'][:12]} --json[/dim]")
    if run_row["stacks"]:
        table_title = None if run_row.get("error") else title
        console.print(stack_table(table_title, run_row["stacks"], confidence))
    for line in skipped_lines(run_row["stacks"]):  # soft_wrap: one line each, however long
        console.print(escape(line), highlight=False, soft_wrap=True)
    for reason in run_row["noisy"]:  # why the speedups above are not to be trusted
        console.print(f"[yellow]noisy: {escape(reason)}[/yellow]", soft_wrap=True)
    for s in run_row["stacks"]:  # invalid timings, input-blind audio, fidelity it lacks
        for line in s["warnings"]:
            console.print(f"[yellow]{escape(line)}[/yellow]", soft_wrap=True)
    env_line = escape(environment_line(run_row.get("environment")))
    console.print(f"[dim]{env_line}[/dim]", soft_wrap=True)
    fidelities = [s for s in run_row["stacks"] if s.get("fidelity")]
    if fidelities:
        scope = escape(fidelity_scope(run_row.get("family")))
        console.print(f"[dim]{scope}[/dim]", soft_wrap=True)
    for s in run_row["stacks"]:
        if s.get("error"):
            console.print(f"[red]{escape(s['name'])}: {escape(s['error'])}[/red]")
        if s["exactness"] == "failed":  # the plugin's claim, contradicted by the measurement
            console.print(
                f"[red]{escape(s['name'])}: declared exact, measured outside fidelity "
                "tolerance: exactness failed[/red]"
            )
        fid = s.get("fidelity")
        if fid and (s["position"] > 0 or s.get("applied")):  # stock vs itself says nothing
            verdict = fidelity_verdict(fid)
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
            if slots := slot_checks_line(s["name"], fid):
                console.print(escape(slots), highlight=False, soft_wrap=True)


@app.command()
def diff(
    run_a: Annotated[str, typer.Argument(help="Run id or unique prefix (the reference).")],
    run_b: Annotated[str, typer.Argument(help="Run id or unique prefix (compared with a).")],
    threshold: Annotated[
        float, typer.Option(help="Relative change below which a number counts as equal.")
    ] = 0.02,
    allow_protocol_mismatch: Annotated[
        bool,
        typer.Option(help="Diff runs measured under different protocols anyway, marked as such."),
    ] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Only what differs between two runs: settings, environment, stacks and metrics.
    Runs measured under different protocols are refused (exit 2) unless allowed."""
    from orchestrate.reports.run_diff import diff_runs
    from orchestrate.reports.tables import run_diff_tables

    if not threshold >= 0:  # one line in the CLI's words, not typer's boxed range error
        fail(f"--threshold must be >= 0, got {threshold}")
    try:
        store = open_store(db)
        result = diff_runs(
            store.get_run(run_a, utterances=False), store.get_run(run_b, utterances=False),
            threshold, allow_protocol_mismatch,
        )  # fmt: skip
    except (KeyError, LookupError, ValueError) as exc:  # ProtocolError is a ValueError
        fail(str(exc))
    if result.protocol_mismatch:  # allowed, never quiet: on stderr, and first on stdout
        warn(f"PROTOCOL MISMATCH: {result.protocol_mismatch}")
    if as_json:
        return print_json(result.to_json())
    if result.protocol_mismatch:
        console.print(
            "[bold red]PROTOCOL MISMATCH[/bold red]: measured under different protocols; "
            "the numbers below do not compare"
        )
    for table in run_diff_tables(result):
        console.print(table)


@app.command()
def schema(
    name: Annotated[
        str | None, typer.Argument(help=f"One of: {', '.join(sorted(SCHEMAS))}.")
    ] = None,
) -> None:
    """JSON schema of one config file (all of them, keyed by name, without a name)."""
    if name and name not in SCHEMAS:
        fail(f"unknown schema {name!r}; known: {', '.join(sorted(SCHEMAS))}")
    if name:  # bare, so an editor can use it as a file's `$schema`
        return print_json(SCHEMAS[name].model_json_schema())
    print_json({n: SCHEMAS[n].model_json_schema() for n in sorted(SCHEMAS)})


class _progress:
    """Progress fed by the worker's JSON-line events: a bar on a terminal; piped (a log, CI,
    an agent), where a bar prints nothing for a minute or more, one line per phase and one
    per stack as its timing finishes, on stdout (stderr keeps a failure to its one line)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.lines = not console.is_terminal
        self.timed: dict[str, list[float]] = {}  # piped: each stack's latencies so far
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
        if not self.quiet and not self.lines:
            self.bar.start()
        return self.on_event

    def __exit__(self, *exc: object) -> None:
        if not self.quiet and not self.lines:
            self.bar.stop()

    def on_event(self, event: dict[str, Any]) -> None:
        if self.quiet:
            return
        if self.lines:
            return self._line(event)
        if event.get("event") == "progress":
            self.bar.update(
                self.task,
                completed=event["done"],
                total=event["total"],
                description=f"timing {event['stack']}",
            )
        elif event.get("event") == "status":
            self.bar.update(self.task, description=event["message"])

    def _line(self, event: dict[str, Any]) -> None:
        if event.get("event") == "status":
            console.print(escape(event["message"]), highlight=False, soft_wrap=True)
        elif event.get("event") == "progress":
            if not self.timed:
                console.print(f"timing {event['total']} utterances, stacks interleaved")
            self.timed.setdefault(event["stack"], []).append(event.get("latency_s") or 0.0)
            if event["done"] == event["total"]:  # interleaved: every stack ends in this round
                for name, latencies in self.timed.items():
                    console.print(
                        f"timed {escape(name)}: {len(latencies)} utterances, median "
                        f"{statistics.median(latencies):.2f} s",
                        highlight=False,
                    )


from orchestrate.cli import explore as explore_cli  # noqa: E402
from orchestrate.cli import faults as faults_cli  # noqa: E402
from orchestrate.cli import plugins as plugins_cli  # noqa: E402
from orchestrate.cli import protocol as protocol_cli  # noqa: E402
from orchestrate.cli import queue as queue_cli  # noqa: E402
from orchestrate.cli import report as report_cli  # noqa: E402

plugins_cli.register(app)
protocol_cli.register(app)
explore_cli.register(app)
report_cli.register(app)
queue_cli.register(app)
faults_cli.register(app)  # last: it wraps every command registered before it
