"""`orchestrate submit`, `queue`, `cancel` and `workers`: the job queue from the terminal.

`submit` plans a job as `run` does (every refusal before anything is queued) and returns
its id at once; `workers` starts a pool on this host that drains the queue (one worker per
GPU, or `cpu:N`; `--backend ray`: on a Ray cluster's GPUs), or without `--gpus` shows the
live workers (with `--backend ray`, the cluster's nodes); `queue` shows every job with
where it runs, its heartbeat and its last progress line; `cancel` stops a job.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from orchestrate.api.records import utcnow
from orchestrate.cli.common import (
    DbOpt,
    JsonOpt,
    ProtocolOpt,
    console,
    fail,
    open_store,
    print_json,
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
from orchestrate.reports.tables import ReadableTable


def submit(
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
    priority: Annotated[int, typer.Option(help="Higher runs first; equal: oldest first.")] = 0,
    min_gpu_memory: Annotated[
        float | None, typer.Option("--min-gpu-memory", help="GB of GPU memory a worker needs.")
    ] = None,
    gpu_model: Annotated[
        str | None,
        typer.Option(help="Only a GPU whose name contains this (e.g. H200): comparability."),
    ] = None,
    runs_dir: Annotated[
        Path, typer.Option(help="Where the worker writes jobs, results and WAVs.")
    ] = Path("runs"),
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Plan a job as `run` does and queue it for a worker pool; prints its id at once."""
    from orchestrate.cli.planning import plan_cli_job
    from orchestrate.running.executor import Submission

    if min_gpu_memory is not None and min_gpu_memory <= 0:
        fail(f"--min-gpu-memory must be > 0 GB, got {min_gpu_memory:g}")
    job, store = plan_cli_job(
        stack, baseline, model, workload, device, dtype, strict, prefixes, fidelity_steps,
        protocol, runs_dir.resolve(), db, "orchestrate submit", check_device=False,
    )  # fmt: skip
    sub = Submission(
        job, force=force, priority=priority, min_gpu_memory_gb=min_gpu_memory, gpu_model=gpu_model
    )
    job_id = store.enqueue(job, sub.requirements(), priority=priority, options=sub.options())
    if as_json:
        print_json({"job_id": job_id, "state": "PENDING"})
        return
    console.print(
        f"queued job {job_id} ({len(job.stacks)} stacks, {job.model.preset} on "
        f"{job.model.device}); `orchestrate queue` follows it, `orchestrate workers` runs it"
    )


def queue(
    state: Annotated[
        list[str] | None,
        typer.Option("--state", help="PENDING, RUNNING, DONE, FAILED or CANCELLED; repeatable."),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Jobs shown, newest first.")] = 50,
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The job queue: pending (with why no worker takes it), running (worker, device,
    heartbeat age, progress), done (its run) and failed (why, and every attempt)."""
    from orchestrate.api.scheduling import JOB_STATES

    states = tuple(s.upper() for s in state or ())
    if bad := [s for s in states if s not in JOB_STATES]:
        fail(f"--state {bad[0]}: one of {', '.join(JOB_STATES)}")
    store = open_store(db)
    store.reap_dead()
    jobs = store.list_jobs(states or None, limit=limit)
    workers = store.live_workers()
    for job in jobs:
        job["waiting_because"] = _why_pending(job, workers) if job["state"] == "PENDING" else None
    if as_json:
        print_json(jobs)
        return
    if not jobs:
        console.print("the queue is empty (`orchestrate submit` queues a job)")
        return
    table = Table(title=f"jobs ({len(workers)} live workers)")
    for col in ("job", "state", "stacks", "where", "heartbeat", "attempts", "status"):
        table.add_column(col, overflow="fold")
    for job in jobs:
        table.add_row(
            job["id"],
            job["state"],
            escape(job["label"]),
            escape(job["device"] or "-") if job["state"] != "PENDING" else "-",
            _age(job["heartbeat_at"]) if job["state"] == "RUNNING" else "-",
            f"{job['attempts']}/{job['max_attempts']}",
            escape(_status(job)),
        )
    console.print(table)


def cancel(
    job: Annotated[str, typer.Argument(help="Job id or prefix (orchestrate queue).")],
    db: DbOpt = None,
) -> None:
    """Cancel a queued job; a running one is stopped by its worker within a heartbeat."""
    from orchestrate.store.queue import JobNotFound

    store = open_store(db)
    try:
        before = store.cancel_job(job)
    except JobNotFound as exc:
        fail(str(exc))
    if before["state"] in ("DONE", "FAILED", "CANCELLED"):
        console.print(f"job {before['id']} is {before['state']} already: nothing changed")
        return
    where = f" (stopping it on {before['worker_id']})" if before["state"] == "RUNNING" else ""
    console.print(f"job {before['id']} cancelled{where}")


class Backend(StrEnum):
    local = "local"
    ray = "ray"


def workers(
    gpus: Annotated[
        str | None,
        typer.Option(help="Start a pool: all, 0,1 (GPU indices) or cpu:N (N CPU workers)."),
    ] = None,
    exit_when_idle: Annotated[
        bool, typer.Option(help="Stop when no job is left that the pool could run.")
    ] = False,
    mlflow: Annotated[bool, typer.Option(help="Log each run to MLflow too.")] = True,
    runs_dir: Annotated[
        Path, typer.Option(help="Where the workers write jobs, results and WAVs.")
    ] = Path("runs"),
    poll: Annotated[float, typer.Option(min=0.05, help="Seconds between queue polls.")] = 1.0,
    heartbeat: Annotated[float, typer.Option(min=0.05, help="Seconds between heartbeats.")] = 5.0,
    stale_after: Annotated[
        float,
        typer.Option(min=1.0, help="Seconds of silence after which another host's worker is dead."),
    ] = 120.0,
    backend: Annotated[
        Backend, typer.Option(help="local: processes on this host; ray: a Ray cluster's GPUs.")
    ] = Backend.local,
    address: Annotated[
        str,
        typer.Option(
            help="With --backend ray: local (a cluster in this process), auto (the one "
            "running here) or HOST:PORT / ray://HOST:PORT."
        ),
    ] = "auto",
    db: DbOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Start a pool of workers (--gpus), or list the live ones (no --gpus; with --backend
    ray, the cluster's GPUs and which jobs run where)."""
    from orchestrate.running.pool import Cadence
    from orchestrate.store.errors import StoreError  # PoolRefused, a database gone away

    store = open_store(db)
    # one event a line, never wrapped: a log a reader greps (console wraps at 160 when piped)
    say = lambda line: console.print(escape(line), highlight=False, soft_wrap=True)  # noqa: E731
    cadence = Cadence(poll, heartbeat, stale_after)
    if backend is Backend.ray:
        from orchestrate.running import ray_pool

        try:
            if gpus is None:
                return _list_cluster(store, ray_pool.connect(address), as_json)
            rc = ray_pool.start_ray_pool(
                store, address, gpus, runs_dir.resolve(), track=mlflow,
                exit_when_idle=exit_when_idle, cadence=cadence, say=say,
            )  # fmt: skip
        except (ray_pool.RayUnavailable, StoreError) as exc:
            fail(str(exc))
        raise typer.Exit(rc)
    if gpus is None:
        return _list_workers(store, as_json)
    from orchestrate.running.pool import parse_slots, start_pool

    try:
        slots = parse_slots(gpus, _gpu_count)
    except ValueError as exc:
        fail(str(exc))
    try:
        rc = start_pool(
            store, store.url, slots, runs_dir.resolve(), track=mlflow,
            exit_when_idle=exit_when_idle, cadence=cadence, say=say,
        )  # fmt: skip
    except StoreError as exc:
        fail(str(exc))
    raise typer.Exit(rc)


def _list_cluster(store: Any, ray: Any, as_json: bool) -> None:
    """The Ray cluster's nodes (GPUs, CPU slots) and the jobs its pool runs on each."""
    from orchestrate.running.ray_pool import describe_cluster

    store.reap_dead()
    nodes = describe_cluster(ray)
    live = [w for w in store.live_workers() if w["slot"].startswith("ray:")]
    for node in nodes:
        node["workers"] = [
            {"slot": w["slot"], "job": w["job_id"], "heartbeat_at": w["heartbeat_at"]}
            for w in live
            if w["slot"].split(":")[1] == node["node"]
        ]
    if as_json:
        print_json(nodes)
        return
    table = ReadableTable(title=f"Ray cluster: {len(nodes)} nodes")
    for col in ("node", "GPUs", "CPU slots", "jobs running"):
        table.add_column(col)
    for n in nodes:
        gpus = f"{n['gpus']} x {n['gpu_type']}" if n["gpu_type"] else str(n["gpus"])
        jobs = ", ".join(f"{w['slot']}: {w['job'] or 'idle'}" for w in n["workers"])
        table.add_row(n["node"], gpus, str(n["cpu_slots"]), jobs or "no pool worker")
    console.print(table)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _list_workers(store: Any, as_json: bool) -> None:
    store.reap_dead()
    live = store.live_workers()
    if as_json:
        print_json(live)
        return
    if not live:
        console.print("no live workers (`orchestrate workers --gpus all|0,1|cpu:N` starts a pool)")
        return
    table = Table(title="live workers")
    for col in ("worker", "device", "job", "heartbeat", "since"):
        table.add_column(col, overflow="fold")
    for w in live:
        caps = w["capabilities"]
        device = caps.get("gpu_name") or caps["device"]
        table.add_row(
            w["id"], device, w["job_id"] or "idle", _age(w["heartbeat_at"]), str(w["started_at"])
        )
    console.print(table)


def _why_pending(job: dict[str, Any], workers: list[dict[str, Any]]) -> str:
    from orchestrate.api.scheduling import Capabilities, Requirements, why_not

    if not workers:
        return "no live worker (orchestrate workers --gpus ... starts a pool)"
    req = Requirements.model_validate(job["requirements"])
    reasons = [why_not(req, Capabilities.model_validate(w["capabilities"])) for w in workers]
    if any(r is None for r in reasons):
        return "waiting for a free worker"
    return f"no live worker can run it: {reasons[0]}"


def _status(job: dict[str, Any]) -> str:
    if job["state"] == "PENDING":
        return job["waiting_because"] or ""
    if job["state"] == "RUNNING":
        return job["progress"] or "started"
    if job["state"] == "DONE":
        return f"run {job['run_id'][:12]}" if job["run_id"] else "done"
    return job["error"] or job["state"].lower()


def _age(t: datetime | None) -> str:
    return "-" if t is None else f"{(utcnow() - t).total_seconds():.0f} s ago"


def register(app: typer.Typer) -> None:
    for command in (submit, queue, cancel, workers):
        app.command()(command)
