"""`orchestrate explore | explorations | proposers`: the autonomous exploration loop.

Registered into the main app by cli/app.py (`explore_cli.register(app)`). Bad input (an
unknown proposer, a budget of zero, a workload without development prompts, a `--from`
stack that does not validate, an unknown exploration) ends the command with one line and
exit 2 before anything is written; an interrupted exploration exits 130 and resumes with
`orchestrate explore --resume ID`.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from orchestrate.api import protocol as proto
from orchestrate.api.config import (
    ConfigError,
    ModelSpec,
    StackSpec,
    Workload,
    load_model_spec,
    load_stack,
    load_workload,
    without_pydantic_detail,
)
from orchestrate.api.protocol import Protocol, load_protocol
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.cli.common import (
    DbOpt,
    JsonOpt,
    console,
    err,
    fail,
    open_store,
    print_json,
    warn,
)

DEFAULT_BUDGET = "1h"
DEFAULT_PATIENCE = 8
DEFAULT_PER_JOB = 4
# Options that define an exploration: `--resume` continues the recorded one, so none of
# them may be given with it (a new --budget may: that is how a finished budget is extended).
_DEFINING = (
    "model",
    "device",
    "workload",
    "from_",
    "proposer",
    "agent_cmd",
    "proposer_option",
    "patience",
    "target",
    "protocol",
    "holdout",
    "fidelity_steps",
    "per_job",
)


def explore(
    model: Annotated[
        str | None, typer.Option(help="Model preset or weights folder (default: tiny).")
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: the preset's).")] = (
        None
    ),
    workload: Annotated[
        str | None,
        typer.Option(help="Development workload (default: the family's); its prompts only."),
    ] = None,
    from_: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Start from `stock` (default), `champion` (the recorded one for this model, "
            "workload and hardware) or a stack name or YAML.",
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option(
            help=f"Time ('2h', '30m'), jobs ('200 jobs') or both (default {DEFAULT_BUDGET})."
        ),
    ] = None,
    proposer: Annotated[
        list[str] | None,
        typer.Option(help="Proposer plugin (repeatable; default: every installed one but agent)."),
    ] = None,
    agent_cmd: Annotated[
        str | None,
        typer.Option(help="Command of the `agent` proposer (state JSON in, proposals JSON out)."),
    ] = None,
    proposer_option: Annotated[
        list[str] | None,
        typer.Option(help="NAME.KEY=VALUE for a proposer (VALUE read as JSON when it parses)."),
    ] = None,
    patience: Annotated[
        int | None,
        typer.Option(
            help=f"Stop after K proposals in a row without a gain (default {DEFAULT_PATIENCE})."
        ),
    ] = None,
    target: Annotated[
        float | None,
        typer.Option(help="Stop once the champion is this much faster than stock (paired)."),
    ] = None,
    protocol: Annotated[
        str | None,
        typer.Option(help="Protocol name or YAML path; it must define gates (`noise` first)."),
    ] = None,
    holdout: Annotated[
        Path | None,
        typer.Option(help="Sealed holdout file for the gate (default configs/holdout/NAME.yaml)."),
    ] = None,
    fidelity_steps: Annotated[
        int | None, typer.Option(help="Teacher-forced steps compared against stock (default 32).")
    ] = None,
    per_job: Annotated[
        int | None,
        typer.Option(
            help="Candidates measured together in one dev job, interleaved with stock and "
            f"the champion (default {DEFAULT_PER_JOB})."
        ),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="Continue an interrupted exploration (id or prefix) where it stopped; a "
            "finished one goes on with a new --budget (patience counts afresh if it stopped it)."
        ),
    ] = None,
    mlflow: Annotated[bool, typer.Option(help="Log to MLflow as well as the database.")] = True,
    runs_dir: Annotated[
        Path | None, typer.Option(help="Jobs, results and WAVs (default: runs).")
    ] = (None),
    fresh_worker: Annotated[
        bool,
        typer.Option(
            help="A new worker process per job, instead of one kept warm for the whole "
            "exploration (which builds the model once and reuses it while its checksum holds)."
        ),
    ] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Propose stacks, measure them against the champion, remeasure, gate; until the budget,
    the patience or the proposers run out. Every decision is recorded with its reason."""
    from orchestrate.explore.budget import BudgetError, parse_budget

    given = locals()
    try:
        parsed_budget = parse_budget(budget) if budget is not None else None
    except BudgetError as exc:
        fail(str(exc))
    if resume is not None:
        named = [k for k in _DEFINING if given[k] not in (None, [])]
        if named:
            flags = ", ".join("--" + k.rstrip("_").replace("_", "-") for k in named)
            fail(f"--resume continues the recorded exploration as it was; drop {flags}")
        return _resume(resume, budget, parsed_budget, runs_dir, mlflow, fresh_worker, db, as_json)
    if patience is not None and patience < 1:
        fail(f"--patience must be >= 1, got {patience}")
    if per_job is not None and per_job < 1:
        fail(f"--per-job must be >= 1, got {per_job}")
    if target is not None and not target > 1:
        fail(f"--target must be a speedup above 1, got {target}")
    options = {
        "budget": budget or DEFAULT_BUDGET,
        "proposers": _proposer_names(proposer, agent_cmd),
        "proposer_options": _proposer_options(proposer_option, agent_cmd),
        "patience": patience or DEFAULT_PATIENCE,
        "target": target,
        "runs_dir": str(runs_dir or Path("runs")),
        "holdout": None if holdout is None else str(holdout),
        "fidelity_steps": 32 if fidelity_steps is None else fidelity_steps,
        "per_job": per_job or DEFAULT_PER_JOB,
    }
    if options["fidelity_steps"] < 0:
        fail(f"--fidelity-steps must be >= 0, got {fidelity_steps}")
    try:
        spec = load_model_spec(model or "tiny", device=device)
        family = get_family(spec.family)
        dev = _dev_workload(workload or family.workload)
        current = load_protocol(protocol or "protocol")
        proto.require_gates(current)  # the gate needs noise-derived gates: noise first
        stock = load_stack(family.baseline)
    except (ConfigError, StackError, proto.ProtocolError) as exc:
        fail(str(exc))
    _check_proposers(options["proposers"], options["proposer_options"])
    _check_holdout(dev, options["holdout"])
    store = open_store(db)
    _check_leaks(store, dev, stock, current)
    root, root_headline = _root(store, from_ or "stock", spec, dev, stock)
    try:
        store.register_protocol(current)  # edited in place under a recorded version: refused
    except proto.ProtocolError as exc:
        fail(str(exc))
    from orchestrate.research import decide
    from orchestrate.running.runner import preflight

    preflight(Path(options["runs_dir"]), mlflow)  # a bad folder or MLflow: one line, exit 2
    exploration_id = store.begin_exploration(
        family=spec.family,
        model=spec.model_dump(mode="json"),
        workload_name=dev.name,
        workload=dev.model_dump(mode="json"),
        hardware=decide.local_hardware(spec.device),
        protocol_hash=current.content_hash(),
        protocol=current.model_dump(mode="json"),
        root=root.model_dump(mode="json"),
        champion=root.model_dump(mode="json"),
        champion_headline=root_headline,
        options=options | {"stock": stock.model_dump(mode="json"), "track": mlflow},
    )
    if not as_json:
        limit = parse_budget(options["budget"]).describe()
        console.print(f"exploration {exploration_id[:12]}: from {root.name}, budget {limit}")
    _drive(store, exploration_id, parsed_budget, mlflow, not fresh_worker, as_json)


def _resume(
    ref: str,
    budget: str | None,
    parsed: Any,
    runs_dir: Path | None,
    mlflow: bool,
    fresh_worker: bool,
    db: str | None,
    as_json: bool,
) -> None:
    from orchestrate.store.explorations import ExplorationNotFound

    store = open_store(db)
    try:
        row = store.get_exploration(ref)
    except ExplorationNotFound as exc:
        fail(str(exc))
    short = row["id"][:12]
    if row["status"] == "RUNNING":
        fail(f"exploration {short} is running (pid {row['pid']} on {row['host']})")
    if row["status"] == "FINISHED" and budget is None:
        fail(
            f"exploration {short} is FINISHED ({row['stop_reason']}); give a new --budget to "
            "go on with it"
        )
    _same_hardware(row)
    options = row["options"] | ({"runs_dir": str(runs_dir)} if runs_dir else {})
    if row["status"] == "FINISHED" and str(row["stop_reason"]).startswith("patience"):
        # A new budget for an exploration its patience stopped: patience counts again from
        # here (else the loop would stop at once, the budget given for nothing).
        options["patience_from"] = max((c["seq"] for c in row["candidates"]), default=0)
        if not as_json:
            console.print(f"patience counts afresh: it stopped on it ({row['stop_reason']})")
    if parsed is not None:  # T more on top of what it spent, not T in all
        parsed = parsed.after(row["elapsed_s"], row["jobs"])
        options["budget"] = parsed.spec()
        if not as_json:
            console.print(f"budget: {budget} more, {parsed.describe()} in all")
    store.update_exploration(row["id"], options=options)
    store.claim_exploration(row["id"])
    if not as_json:
        done = sum(c["status"] == "decided" for c in row["candidates"])
        champion = row["champion"]["name"]
        console.print(f"exploration {short} resumes: {done} decided, champion {champion}")
    _drive(
        store, row["id"], parsed, mlflow and options.get("track", True), not fresh_worker, as_json
    )


def _same_hardware(row: dict[str, Any]) -> None:
    """An exploration's candidates are judged against numbers measured on its hardware: a
    resume elsewhere (an H200's exploration on an H100) would mix them, so it is refused."""
    from orchestrate.api.config import ModelSpec
    from orchestrate.research import decide

    here = decide.local_hardware(ModelSpec.model_validate(row["model"]).device)
    if here != row["hardware"]:
        fail(
            f"exploration {row['id'][:12]} was measured on {row['hardware']}; this host is "
            f"{here}: its numbers would not compare. Resume it on {row['hardware']}, or start "
            "a new exploration here"
        )


def _drive(
    store: Any, exploration_id: str, budget: Any, track: bool, warm: bool, as_json: bool
) -> None:
    """Build the exploration's setup from its row and run the loop to a stop."""
    from orchestrate.explore.budget import parse_budget
    from orchestrate.explore.loop import Explorer, Setup
    from orchestrate.explore.plugins import BadProposer, load_proposers
    from orchestrate.explore.submit import LocalSubmitter
    from orchestrate.running.runner import Interrupted

    row = store.get_exploration(exploration_id)
    options = row["options"]
    context = {"exploration": exploration_id, "storage_url": store.url}  # e.g. params' study
    proposer_options = {
        n: context | options["proposer_options"].get(n, {}) for n in options["proposers"]
    }
    try:
        proposers = load_proposers(options["proposers"], proposer_options)
    except BadProposer as exc:  # a plugin broken since the exploration began
        fail(str(exc))
    runs_dir = Path(options["runs_dir"])
    say = (
        (lambda line: None)
        if as_json
        else (lambda line: err.print(line, markup=False, highlight=False))
    )
    setup = Setup(
        store=store,
        model=ModelSpec.model_validate(row["model"]),
        dev=Workload.model_validate(row["workload"]),
        protocol=Protocol.model_validate(row["protocol"]),
        stock=StackSpec.model_validate(options["stock"]),
        proposers=proposers,
        budget=budget or parse_budget(options["budget"]),
        patience=options["patience"],
        target=options.get("target"),
        submitter=LocalSubmitter(
            store, runs_dir, track=track, on_event=_status(as_json), warm=warm
        ),
        runs_dir=runs_dir,
        track=track,
        holdout_file=Path(options["holdout"]) if options["holdout"] else None,
        fidelity_steps=options["fidelity_steps"],
        per_job=options.get("per_job", 1),  # explorations recorded before rounds: one each
        say=say,
        on_event=_status(as_json),
    )
    explorer = Explorer(setup, exploration_id)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        explorer.run()
    except (KeyboardInterrupt, Interrupted) as exc:
        why = f"interrupted ({str(exc) or 'Ctrl-C'})"
        explorer.close("INTERRUPTED", why)
        fail(f"{why}; resume with: orchestrate explore --resume {exploration_id[:12]}", 130)
    finally:
        setup.submitter.close()
        signal.signal(signal.SIGTERM, previous)
    for warning in setup.warnings:
        warn(warning)
    final = store.get_exploration(exploration_id)
    print_json(final) if as_json else show_exploration(final)


def _interrupt(signum: int, frame: object) -> None:
    from orchestrate.running.runner import Interrupted

    raise Interrupted(f"orchestrator received {signal.Signals(signum).name}")


def _status(quiet: bool) -> Any:
    def on_event(event: dict[str, Any]) -> None:
        if not quiet and event.get("event") == "status":
            err.print(f"[dim]{event['message']}[/dim]")

    return on_event


# --------------------------------------------------------------------- bad input, early


def _dev_workload(name: str) -> Workload:
    """The development workload; one without development prompts is refused by name."""
    from orchestrate.api import sealed

    try:
        dev = load_workload(name).single_stream("orchestrate explore")
    except ConfigError as exc:
        if "sealed_holdout" in str(exc) or "prompts" in str(exc):
            raise ConfigError(f"workload {name!r} has no development prompts ({exc})") from exc
        raise
    if all(sealed.is_placeholder(p.text) for p in dev.prompts):
        raise ConfigError(f"workload {name!r} has no development prompts (only sealed ones)")
    return dev


def _proposer_names(names: list[str] | None, agent_cmd: str | None) -> list[str]:
    from orchestrate.explore.plugins import default_names

    chosen = list(dict.fromkeys(names or default_names()))
    if agent_cmd and "agent" not in chosen:
        chosen.append("agent")
    return chosen


def _proposer_options(pairs: list[str] | None, agent_cmd: str | None) -> dict[str, dict]:
    out: dict[str, dict[str, Any]] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        name, dot, option = key.partition(".")
        if not (sep and dot and name and option):
            fail(f"--proposer-option must be NAME.KEY=VALUE, got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(name, {})[option] = value
    if agent_cmd:
        out.setdefault("agent", {})["cmd"] = agent_cmd
    return out


def _check_proposers(names: list[str], options: dict[str, dict]) -> None:
    from orchestrate.explore.plugins import BadProposer, load_proposers

    try:
        load_proposers(names, options)  # instances are made again, with context, to run
    except BadProposer as exc:
        fail(str(exc))
    if not names:
        fail("no proposer installed or named (--proposer)")


def _check_holdout(dev: Workload, given: str | None) -> None:
    from orchestrate.research.holdout import holdout_path

    path = Path(given) if given else holdout_path(dev.name)
    if not path.is_file():
        fail(f"no sealed holdout for workload {dev.name!r}: {path} is missing (--holdout FILE)")


def _check_leaks(store: Any, dev: Workload, stock: StackSpec, protocol: Protocol) -> None:
    """A workload holding a holdout text is refused, and the refusal audited, as plan_job
    would for every job of the exploration."""
    from orchestrate.api import sealed
    from orchestrate.research.holdout import audit_refusal

    leaks = sealed.find_leaks(dev)
    if leaks:
        exc = sealed.HoldoutLeak(dev.name, leaks, [stock], protocol.content_hash())
        audit_refusal(store, exc, "orchestrate explore")
        fail(str(exc))


def _root(
    store: Any, ref: str, spec: ModelSpec, dev: Workload, stock: StackSpec
) -> tuple[StackSpec, float | None]:
    """The stack to start from (stock, the recorded champion, or a stack that validates),
    and its headline vs stock where one is recorded (a champion's, from its holdout)."""
    from orchestrate.research import decide

    if ref == "stock":
        return stock, None
    if ref == "champion":
        hardware = decide.local_hardware(spec.device)
        key = decide.model_key(spec)
        champ = decide.current_champion(store, spec.family, key, dev.name, hardware)
        if champ is None:
            where = f"{spec.family} {key} on {dev.name} ({hardware})"
            fail(f"--from champion: no champion recorded for {where}; start from stock")
        return decide.champion_spec(champ), champ["speedup"]
    try:
        root = load_stack(ref)
        if root.family != spec.family:
            raise StackError(
                f"stack {root.name!r} is for {root.family!r}; model is {spec.family!r}"
            )
        build_stack(root)
    except (ConfigError, StackError) as exc:
        fail(f"--from {ref}: {exc}")
    return root, None


# ------------------------------------------------------------------------ listing


def explorations(
    exploration: Annotated[
        str | None, typer.Argument(help="One exploration (id or prefix): its candidates.")
    ] = None,
    limit: Annotated[int, typer.Option(help="How many, newest first.")] = 20,
    records: Annotated[
        bool,
        typer.Option(
            help="With one exploration and --json: each candidate run's result record "
            "(GPU, versions, git SHA, host CPU) under `runs`, as a committed record keeps it."
        ),
    ] = False,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Explorations: started, status, why they stopped, champion and headline, candidates."""
    from orchestrate.store.explorations import ExplorationNotFound

    store = open_store(db)
    if records and (exploration is None or not as_json):
        fail("--records needs one exploration and --json")
    if exploration is not None:
        try:
            row = store.get_exploration(exploration)
        except ExplorationNotFound as exc:
            fail(str(exc))
        if records:
            row["runs"] = _records(store, row)
        return print_json(row) if as_json else show_exploration(row)
    if limit < 1:
        fail(f"--limit must be >= 1, got {limit}")
    rows = store.list_explorations(limit)
    if as_json:
        return print_json(rows)
    table = Table(title="explorations")
    for col in ("id", "started", "status", "stop reason", "champion", "headline", "candidates"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["id"][:12],
            str(r["started_at"])[:19],
            r["status"],
            r["stop_reason"] or "",
            r["champion"]["name"],
            _headline(r["champion_headline"], r["champion_lo"], r["champion_hi"]),
            str(r["candidates"]),
        )
    console.print(table)


def _records(store: Any, row: dict[str, Any]) -> dict[str, Any]:
    """Run id -> its result record, for every run a candidate was decided on (a run the
    worker never finished has none, and says so)."""
    from orchestrate.store.errors import StoreError

    out: dict[str, Any] = {}
    for run_id in dict.fromkeys(r for c in row["candidates"] for r in c["run_ids"]):
        try:
            out[run_id] = store.get_result(run_id).model_dump(mode="json")
        except StoreError as exc:  # a run that never finished: reported, not fatal
            out[run_id] = {"error": f"no result record: {exc}"}
    return out


def show_exploration(row: dict[str, Any]) -> None:
    from orchestrate.explore.decisions import unjudged_gains
    from orchestrate.reports.tables import ReadableTable

    table = ReadableTable(
        title=f"exploration {row['id'][:12]} · {row['status']} · {row['workload_name']} · "
        f"{row['hardware']} · {row['jobs']} jobs, {row['elapsed_s'] / 60:.1f} min"
    )
    for col in ("#", "proposer", "change", "stack", "vs parent", "vs stock", "decision", "why"):
        table.add_column(col)
    for c in row["candidates"]:
        table.add_row(
            str(c["seq"]),
            c["proposer"],
            c["change"],
            c["stack_name"] or "-",
            _headline(c["vs_parent"], c["vs_parent_lo"], c["vs_parent_hi"]),
            _headline(c["headline"], c["headline_lo"], c["headline_hi"]),
            c["decision"] or f"open ({c['phase']})",
            # whole: why a stack was retained is what a reader wants
            without_pydantic_detail(c["reason"] or ""),
        )
    console.print(table)
    champion = row["champion"]["name"]
    headline = _headline(row["champion_headline"], row["champion_lo"], row["champion_hi"])
    console.print(f"champion: {champion} ({headline} vs stock, paired)")
    for c in unjudged_gains(row["candidates"]):
        gain = _headline(c["vs_parent"], c["vs_parent_lo"], c["vs_parent_hi"])
        console.print(
            f"not judged, faster than {c['parent_name']} ({gain}): #{c['seq']} {c['change']}: "
            "its quality needs a gate on real weights"
        )
    if row["stop_reason"]:
        console.print(f"stopped: {row['stop_reason']}")


def _headline(point: float | None, lo: float | None, hi: float | None) -> str:
    if point is None:
        return "-"
    return f"{point:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")


def proposers(as_json: JsonOpt = False) -> None:
    """Installed proposer plugins (and broken ones, with the reason)."""
    from orchestrate.explore.plugins import proposer_catalogue

    cat = proposer_catalogue()
    rows: list[dict[str, Any]] = [
        {"name": n, "summary": c.summary, "module": c.__module__}
        for n, c in sorted(cat.proposers.items())
    ]
    rows += [
        {"name": b.name, "broken": True, "target": b.target, "error": b.error}
        for _, b in sorted(cat.broken.items())
    ]
    if as_json:
        return print_json(rows)
    table = Table(title="proposers")
    for col in ("name", "summary", "module"):
        table.add_column(col)
    for r in rows:
        if r.get("broken"):
            table.add_row(r["name"], f"[red]BROKEN: {r['error']}[/red]", r["target"])
        else:
            table.add_row(r["name"], r["summary"], r["module"])
    console.print(table)


def register(app: typer.Typer) -> None:
    for command in (explore, explorations, proposers):
        app.command()(command)
