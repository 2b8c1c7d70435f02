"""A pool of long-lived workers on this host, one per GPU (or CPU slot): `orchestrate workers`.

The pool process starts one member process per slot, with CUDA_VISIBLE_DEVICES naming its
GPU (empty for a CPU slot), so a GPU is never shared by two timed jobs. Each member claims
jobs from the queue (store.queue) one at a time, runs each in its own warm worker
subprocess (the built model is kept between jobs of the same model; engines, graphs and
warm-up are per job) and records it with its claim. A member that dies (kill -9, the OOM
killer) is started again, up to `MAX_RESTARTS` times a slot; its job is given back by
`reap_dead` (any member's next poll) and re-runs on whichever member claims it first.

One pool drains one database: the pool's own row in `pool_workers` is its lock, taken in
the same transaction that checks for another live pool.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal

from orchestrate.api.scheduling import Capabilities
from orchestrate.running.executor import run_claimed
from orchestrate.running.runner import Interrupted, WorkerLaunch, WorkerLost, die_with_parent
from orchestrate.running.warm import WarmWorker
from orchestrate.store.errors import StoreError
from orchestrate.store.queue import ClaimLost

MAX_RESTARTS = 3  # a slot whose member keeps dying is given up after this many restarts
Say = Callable[[str], None]


@dataclass(frozen=True)
class Cadence:
    """How often a pool looks at the queue and beats, and when a silent worker is dead."""

    poll_s: float = 1.0
    beat_s: float = 5.0
    stale_s: float = 120.0  # another host's worker silent this long is taken for dead

    def args(self) -> list[str]:
        return ["--poll-s", str(self.poll_s), "--beat-s", str(self.beat_s),
                "--stale-s", str(self.stale_s)]  # fmt: skip


@dataclass(frozen=True)
class Slot:
    name: str  # "0" (a GPU index, as CUDA_VISIBLE_DEVICES names it) or "cpu:1"
    device: Literal["cpu", "cuda"]

    @property
    def visible(self) -> str:
        return "" if self.device == "cpu" else self.name


def parse_slots(spec: str, gpu_count: Callable[[], int]) -> list[Slot]:
    """`all` (every GPU here), `0,1` (those GPUs) or `cpu:N` (N CPU workers)."""
    spec = spec.strip()
    if spec.startswith("cpu:"):
        n = spec.removeprefix("cpu:")
        if not n.isdigit() or not 1 <= int(n) <= 64:
            raise ValueError(f"--gpus {spec}: cpu:N needs N between 1 and 64")
        return [Slot(f"cpu:{i}", "cpu") for i in range(int(n))]
    count = gpu_count()
    if spec == "all":
        if count == 0:
            raise ValueError("--gpus all: no CUDA GPU is visible here (cpu:N runs CPU workers)")
        return [Slot(str(i), "cuda") for i in range(count)]
    names = [p.strip() for p in spec.split(",")]
    if not all(n.isdigit() for n in names) or len(set(names)) != len(names):
        raise ValueError(f"--gpus {spec}: expected all, cpu:N or distinct GPU indices like 0,1")
    if missing := [n for n in names if int(n) >= count]:
        raise ValueError(f"--gpus {spec}: GPU {missing[0]} is not here ({count} visible)")
    return [Slot(n, "cuda") for n in names]


# ---------------------------------------------------------------------------- member


@dataclass
class Member:
    """What one pool member runs its jobs with. A local member is a process of its own on
    one GPU (`local_member`); a Ray member is a thread here whose jobs run in a Ray actor
    holding one GPU somewhere in the cluster (running.ray_pool)."""

    worker_id: str
    slot: str
    caps: Capabilities
    launch: WorkerLaunch
    close: Callable[[], None]
    # Before each claim: can its worker take a job? (A Ray actor restarting after a death
    # is waited for; one gone for good ends the member instead of failing jobs.)
    ready: Callable[[], bool] = lambda: True


def local_member(slot: Slot, runs_dir: Path) -> Member:
    """This process on `slot`'s device, its jobs in a warm worker subprocess."""
    families = tuple(sorted(ep.name for ep in entry_points(group="orchestrate.families")))
    (runs_dir / "pool").mkdir(parents=True, exist_ok=True)
    warm = WarmWorker(runs_dir / "pool", name=f"worker-{slot.name.replace(':', '')}")
    return Member(
        f"{socket.gethostname()}:{os.getpid()}:{slot.name}",
        slot.name,
        Capabilities.probe(slot.device, families),
        warm,
        warm.close,
    )


def serve(
    store: Any,
    member: Member,
    runs_dir: Path,
    pool_id: str,
    *,
    track: bool,
    exit_when_idle: bool,
    cadence: Cadence = Cadence(),
    say: Say = print,
    stop: threading.Event | None = None,
) -> int:
    """One member: claim, run, record, until stopped (`stop`, a signal) or idle (with
    `exit_when_idle`). Returns 0, or 1 when its worker was lost more than MAX_RESTARTS
    times (a Ray actor that keeps dying)."""
    name, caps = member.slot, member.caps
    store.register_worker(member.worker_id, pool_id, name, caps)
    say(f"[{name}] ready on {caps.label()}")
    lost = 0
    try:
        while stop is None or not stop.is_set():
            if not member.ready():
                say(f"[{name}] its worker is gone for good: stopping this slot")
                return 1
            if store.reap_dead(cadence.stale_s):
                store.reconcile_stale()  # the dead worker's run row: INTERRUPTED, resumable
            claim = store.claim_job(member.worker_id, caps)
            if claim is None:
                if exit_when_idle and store.jobs_left(caps) == 0:
                    say(f"[{name}] queue empty: stopping")
                    return 0
                store.beat(member.worker_id)
                time.sleep(cadence.poll_s)
                continue
            label = store.get_job(claim.job_id)["label"]
            say(f"[{name}] job {claim.job_id} (attempt {claim.attempt}): {label}")
            t0 = time.monotonic()
            try:
                outcome = run_claimed(
                    store,
                    claim,
                    runs_dir,
                    member.launch,
                    track=track,
                    beat_s=cadence.beat_s,
                    release=True,
                )
            except ClaimLost as exc:
                say(f"[{name}] job {claim.job_id} not recorded: {exc}")
                continue
            except WorkerLost as exc:
                lost += 1
                say(f"[{name}] job {claim.job_id} goes back to the queue: {exc}")
                if lost > MAX_RESTARTS:
                    say(f"[{name}] its worker was lost {lost} times: giving up this slot")
                    return 1
                continue
            except (KeyboardInterrupt, Interrupted):
                raise
            except Exception as exc:
                say(f"[{name}] job {claim.job_id} failed: {type(exc).__name__}: {exc}")
                continue
            what = outcome.error or f"run {outcome.run_id[:12]} {outcome.status}"
            say(f"[{name}] job {claim.job_id} done in {time.monotonic() - t0:.1f} s: {what}")
        return 0
    finally:
        member.close()
        with contextlib.suppress(StoreError):  # gone: reap_dead elsewhere sees the pid gone
            store.unregister_worker(member.worker_id)


def _member_main(argv: list[str] | None = None) -> int:
    """`python -m orchestrate.running.pool`: one member, started by `start_pool`."""
    p = argparse.ArgumentParser(prog="orchestrate pool member")
    p.add_argument("--db", required=True)
    p.add_argument("--runs-dir", required=True, type=Path)
    p.add_argument("--pool-id", required=True)
    p.add_argument("--slot", required=True)
    p.add_argument("--device", required=True, choices=("cpu", "cuda"))
    p.add_argument("--exit-when-idle", action="store_true")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--beat-s", type=float, default=5.0)
    p.add_argument("--stale-s", type=float, default=120.0)
    a = p.parse_args(argv)
    from orchestrate.store.store import Store

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        store = Store(a.db)
    except StoreError as exc:
        print(f"[{a.slot}] {exc}", flush=True)
        return 2
    try:
        return serve(
            store,
            local_member(Slot(a.slot, a.device), a.runs_dir),
            a.runs_dir,
            a.pool_id,
            track=not a.no_mlflow,
            exit_when_idle=a.exit_when_idle,
            cadence=Cadence(a.poll_s, a.beat_s, a.stale_s),
            say=lambda line: print(line, flush=True),
        )
    except (KeyboardInterrupt, Interrupted):
        return 130
    except StoreError as exc:
        print(f"[{a.slot}] stopping: {exc}", flush=True)
        return 2


def _interrupt(signum: int, _frame: object) -> None:
    raise Interrupted(f"worker received {signal.Signals(signum).name}")


# ------------------------------------------------------------------------------ pool


@dataclass
class _Member:
    slot: Slot
    proc: subprocess.Popen[bytes]
    restarts: int = 0


def start_pool(
    store: Any,
    db_url: str,
    slots: list[Slot],
    runs_dir: Path,
    *,
    track: bool,
    exit_when_idle: bool,
    cadence: Cadence = Cadence(),
    say: Say = print,
) -> int:
    """Run a pool until its members stop (idle, with `exit_when_idle`) or it is signalled.
    Raises PoolRefused when another pool drains the database."""
    pool_id = uuid.uuid4().hex[:12]
    lock_id = f"{socket.gethostname()}:{os.getpid()}:pool"
    store.register_worker(lock_id, pool_id, "pool", Capabilities(device="cpu"), lock=True)
    args = [
        "--db",
        db_url,
        "--runs-dir",
        str(runs_dir),
        "--pool-id",
        pool_id,
        *cadence.args(),
    ]
    args += ["--exit-when-idle"] * exit_when_idle + ["--no-mlflow"] * (not track)

    def start(slot: Slot) -> subprocess.Popen[bytes]:
        env = os.environ | {"CUDA_VISIBLE_DEVICES": slot.visible}
        cmd = [sys.executable, "-m", "orchestrate.running.pool", *args]
        cmd += ["--slot", slot.name, "--device", slot.device]
        return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent())

    members = [_Member(slot, start(slot)) for slot in slots]
    say(f"pool {pool_id}: {len(members)} workers ({', '.join(s.name for s in slots)})")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    failed = 0
    try:
        while members:
            time.sleep(cadence.poll_s)
            store.beat(lock_id)
            for m in list(members):
                rc = m.proc.poll()
                if rc is None:
                    continue
                if rc in (0, 2):  # idle and done; or its database failed (it said why)
                    members.remove(m)
                    failed += rc != 0
                    continue
                why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
                if m.restarts >= MAX_RESTARTS:
                    say(f"[{m.slot.name}] worker ended ({why}) {m.restarts} times: giving up")
                    members.remove(m)
                    failed += 1
                    continue
                m.restarts += 1
                say(
                    f"[{m.slot.name}] worker ended ({why}); its job goes back to the queue; "
                    f"restarting it ({m.restarts}/{MAX_RESTARTS})"
                )
                m.proc = start(m.slot)
    except (KeyboardInterrupt, Interrupted):
        say("stopping the pool: running jobs are interrupted (resumable) and given back")
        for m in members:
            m.proc.terminate()
        for m in members:
            try:
                m.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                m.proc.kill()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(StoreError):
            store.unregister_worker(lock_id)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_member_main())
