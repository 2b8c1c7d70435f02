"""Ray as the distributed engine: `orchestrate workers --backend ray --address ...`.

A pool whose members run their jobs on a Ray cluster. Each slot is a Ray actor holding one
GPU (`num_gpus=1`, so Ray places the actors and keeps the books of which GPU is busy: a GPU
is never shared by two timed jobs) or, on a cluster without GPUs (CI), one unit of the
custom resource `CPU_SLOT`. An actor keeps a warm worker subprocess, so the built model is
kept between jobs of the same model (the local pool's reuse rules; engines, graphs and
warm-up stay per job).

The members themselves are threads in this process, the driver, which alone touches the
store: it claims a job (store.queue), ships its job file to the actor, relays the actor's
events, receives the job's folder back (result, journal, WAVs) and records it with its
claim, exactly once by job id, as a local member does. A node never opens the store
or MLflow (running.ray_actor says what it must have installed).

Which job goes to which slot is decided by the same `why_not` as on one host, against what
each actor probed on its own GPU (model, memory, compute capability, families): a job
needing more GPU memory than any node has stays PENDING with that reason in `orchestrate
queue`, where a Ray task asking for a custom resource no node has would hang with a
warning in Ray's log.

Faults: an actor that dies mid-job (kill -9, its node lost) is restarted by Ray
(`max_restarts`); its job goes back to the queue with the attempt recorded
(store.requeue_claimed) and re-runs under `JOB-r2`, up to the job's `max_attempts`. Ray
never re-runs a method by itself (`max_task_retries=0`): every attempt is the queue's,
and visible. A lost cluster (the head, the driver's connection) stops the pool with one
line and exit 1; running jobs go back to the queue, none is marked done that was not.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orchestrate.api.scheduling import Capabilities
from orchestrate.running.pool import MAX_RESTARTS, Cadence, Member, Say, serve
from orchestrate.running.ray_actor import SlotWorker, pack, unpack
from orchestrate.running.runner import Interrupted, WorkerLost
from orchestrate.store.errors import StoreError
from orchestrate.store.probes import first_line

CPU_SLOT = "orchestrate_cpu_slot"  # a cluster's CPU slots: ray start --resources '{...: N}'
RESTART_WAIT_S = 120.0  # an actor not back from a restart within this is given up
PROBE_TIMEOUT_S = 300.0  # an actor that cannot be placed or started within this is refused
HEAD_TIMEOUT_S = 3.0  # a head that takes no TCP connection within this is lost
HEAD_GRACE_S = 8.0  # after an actor's death, how long the head is watched before blaming the job


class RayUnavailable(RuntimeError):
    """Ray is missing, its cluster does not answer, or it cannot offer the slots asked."""


class ClusterLost(Interrupted):
    """The cluster went away under a running pool (its head, or this driver's connection):
    a running job is given back to the queue, as on an interrupt."""


# ---------------------------------------------------------------------- the cluster


def connect(address: str, cpu_slots: int = 0) -> Any:
    """`ray`, initialised: `local` starts a cluster in this process (with `cpu_slots` CPU
    slots); `auto`, `HOST:PORT` or `ray://HOST:PORT` join a running one. One line
    (RayUnavailable) when ray is missing or the address does not answer."""
    # Ray turns token authentication on for clusters it starts and, for `auto`, for the
    # drivers joining them; a driver given HOST:PORT joins without its token unless told
    # (read when ray is imported).
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").exists()
    if address != "local" and token and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        import ray
    except ImportError:
        raise RayUnavailable(
            "the Ray backend needs the ray package: pip install 'orchestrate[ray]'"
        ) from None
    if ray.is_initialized():
        return ray
    quiet: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
    if address == "local":
        ray.init(
            num_cpus=max(2, cpu_slots + 1),
            resources={CPU_SLOT: cpu_slots} if cpu_slots else None,
            include_dashboard=False,
            object_store_memory=256 * 1024 * 1024,  # job folders pass through it, small
            **quiet,
        )
        quiet_cluster_notices(ray)
        return ray
    _check_answers(address)
    try:
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RayUnavailable(
            f"cannot join the Ray cluster at {address}: {first_line(exc)} (start one with "
            "`ray start --head`; a cluster with token authentication needs its token in "
            "RAY_AUTH_TOKEN or ~/.ray/auth_token; --address local starts one in this process)"
        ) from exc
    quiet_cluster_notices(ray)
    return ray


def _check_answers(address: str) -> None:
    """A HOST:PORT that does not take a TCP connection in 3 s: one line, at once (ray.init
    would retry for a minute)."""
    if address == "auto":
        return  # ray.init finds the local cluster, or says at once there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(
            f"--address {address!r}: expected local, auto, HOST:PORT or ray://HOST:PORT"
        )
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as exc:
        raise RayUnavailable(
            f"the Ray cluster at {address} does not answer ({exc.strerror or exc}): start its "
            f"head with `ray start --head --port {port}`, or pass the right --address"
        ) from None


@dataclass(frozen=True)
class RaySlot:
    node_id: str
    node_ip: str
    index: int
    device: Literal["cpu", "cuda"]

    @property
    def name(self) -> str:
        return f"ray:{self.node_ip}:{'gpu' if self.device == 'cuda' else 'cpu'}{self.index}"


def cluster_slots(ray: Any, spec: str) -> list[RaySlot]:
    """`all`: one slot per GPU of every live node; `cpu:N`: N CPU slots, spread over the
    nodes that offer the `CPU_SLOT` resource."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if spec.startswith("cpu:"):
        n = spec.removeprefix("cpu:")
        if not n.isdigit() or not 1 <= int(n) <= 64:
            raise RayUnavailable(f"--gpus {spec}: cpu:N needs N between 1 and 64")
        offered = [(node, int(node["Resources"].get(CPU_SLOT, 0))) for node in nodes]
        if sum(k for _, k in offered) < int(n):
            raise RayUnavailable(
                f"--gpus {spec}: the Ray cluster offers {sum(k for _, k in offered)} CPU slots "
                f"(resource {CPU_SLOT}; start a node with ray start --resources "
                f"'{{\"{CPU_SLOT}\": {n}}}', or pass --address local)"
            )
        slots = [
            RaySlot(node["NodeID"], node["NodeManagerAddress"], i, "cpu")
            for node, k in offered
            for i in range(k)
        ]
        return slots[: int(n)]
    if spec != "all":
        raise RayUnavailable(
            f"--gpus {spec}: with --backend ray, use all (every GPU of the cluster) or cpu:N; "
            "Ray decides which GPU of a node an actor gets"
        )
    slots = [
        RaySlot(node["NodeID"], node["NodeManagerAddress"], i, "cuda")
        for node in nodes
        for i in range(int(node["Resources"].get("GPU", 0)))
    ]
    if not slots:
        raise RayUnavailable("--gpus all: the Ray cluster has no GPU (cpu:N runs CPU slots)")
    return slots


def describe_cluster(ray: Any) -> list[dict[str, Any]]:
    """Each live node: its address, GPUs (count and type) and CPU slots."""
    rows = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node["Resources"]
        kinds = [k.removeprefix("accelerator_type:") for k in res if k.startswith("accel")]
        rows.append(
            {
                "node": node["NodeManagerAddress"],
                "node_id": node["NodeID"],
                "gpus": int(res.get("GPU", 0)),
                "gpu_type": ", ".join(kinds) or None,
                "cpu_slots": int(res.get(CPU_SLOT, 0)),
            }
        )
    return rows


# ------------------------------------------------------------------ on the node: actor


# -------------------------------------------------------------- on the driver: launch


class RayLaunch:
    """A runner.WorkerLaunch whose worker is a slot's actor: the same arguments, events and
    exit status as a local worker, the job's folder shipped there and back."""

    def __init__(self, ray: Any, actor: Any, slot: str, stopping: threading.Event) -> None:
        self.ray, self.actor, self.slot, self.stopping = ray, actor, slot, stopping

    def __call__(self, job_path: Path, result_path: Path, log_path: Path, on_event: Any) -> int:
        folder = job_path.parent
        carried = pack(folder, "", "")  # a resumed job's kept WAVs and journal
        carried.pop("job.json", None)
        final: dict[str, Any] | None = None
        errors = self.ray.exceptions
        try:
            for ref in self.actor.measure.remote(job_path.read_text(), carried):
                item = self.ray.get(ref)
                if "event" in item:
                    on_event(item["event"])
                else:
                    final = item
        except (errors.RayActorError, errors.ActorUnavailableError, errors.WorkerCrashedError,
                errors.NodeDiedError, errors.OutOfMemoryError) as exc:  # fmt: skip
            if self.stopping.is_set():
                raise Interrupted(f"the pool is stopping ({self.slot})") from exc
            # A lost head fails every actor: not this job's attempt. `ray stop` ends the head
            # node's raylet (and so the actor) a few seconds before its GCS: wait that out.
            check_head(self.ray, grace_s=HEAD_GRACE_S)
            raise WorkerLost(f"Ray actor {self.slot} died mid-job: {first_line(exc)}") from exc
        except errors.RayTaskError as exc:  # the actor's code raised: the job failed there
            cause = getattr(exc, "cause", None) or exc
            raise RuntimeError(
                f"on Ray actor {self.slot}: {type(cause).__name__}: {first_line(cause)}"
            ) from None
        except errors.RayError as exc:
            raise ClusterLost(f"lost the Ray cluster: {first_line(exc)}") from exc
        if final is None:
            raise WorkerLost(f"Ray actor {self.slot} ended the job without its result")
        unpack(folder, final["files"], "", "")
        return int(final["rc"])

    def stop_job(self, job_dir: Path) -> None:
        """Stop the job's worker on the actor's node (its claim was cancelled): the actor
        sends it SIGTERM, as the local pool does, and `measure` returns its exit status."""
        self.ray.get(self.actor.stop_job.remote(job_dir.name), timeout=30)


# ------------------------------------------------------------------------ the pool


def start_ray_pool(
    store: Any,
    address: str,
    spec: str,
    runs_dir: Path,
    *,
    track: bool,
    exit_when_idle: bool,
    cadence: Cadence | None = None,
    say: Say = print,
) -> int:
    """Run a pool on a Ray cluster until its members stop (idle, with `exit_when_idle`),
    it is interrupted (130) or the cluster is lost (1). Raises RayUnavailable or
    PoolRefused (another pool drains the database) before anything is claimed."""
    cpu_slots = (
        int(spec.removeprefix("cpu:")) if spec.startswith("cpu:") and spec[4:].isdigit() else 0
    )
    ray = connect(address, cpu_slots)
    slots = cluster_slots(ray, spec)
    pool_id = uuid.uuid4().hex[:12]
    lock_id = f"{socket.gethostname()}:{os.getpid()}:pool"
    store.register_worker(lock_id, pool_id, "pool", Capabilities(device="cpu"), lock=True)
    stopping = threading.Event()
    try:
        actors, members = _start_members(ray, slots, stopping, say)
        rc = _run(store, members, runs_dir, pool_id, lock_id, stopping, track=track,
                  exit_when_idle=exit_when_idle, cadence=cadence or Cadence(), say=say)  # fmt: skip
        if rc == 130:  # their jobs go back to the queue (RayLaunch sees `stopping`)
            for actor in actors:
                ray.kill(actor, no_restart=True)
        return rc
    finally:
        with contextlib.suppress(StoreError):  # the database went away: said by the caller
            store.unregister_worker(lock_id)
        if address == "local":
            ray.shutdown()


def _start_members(
    ray: Any, slots: list[RaySlot], stopping: threading.Event, say: Say
) -> tuple[list[Any], list[Member]]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(SlotWorker)
    actors = []
    for slot in slots:
        placement: dict[str, Any] = (
            {"num_gpus": 1} if slot.device == "cuda" else {"resources": {CPU_SLOT: 1}}
        )
        actors.append(
            remote.options(
                **placement,
                num_cpus=0,  # a slot is its GPU (or CPU slot); the worker's threads are its own
                max_concurrency=2,  # stop_job reaches it while measure streams a job
                scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node_id, soft=False),
                max_restarts=MAX_RESTARTS,
                max_task_retries=0,  # attempts are the queue's, recorded; never Ray's silent ones
            ).remote(slot.name)
        )
    try:
        caps = ray.get(
            [a.probe.remote(s.device) for a, s in zip(actors, slots, strict=True)],
            timeout=PROBE_TIMEOUT_S,
        )
        pids = ray.get([a.pid.remote() for a in actors], timeout=PROBE_TIMEOUT_S)
    except Exception as exc:
        for a in actors:
            ray.kill(a)
        raise RayUnavailable(
            f"the Ray cluster could not start the pool's actors: {first_line(exc)}"
        ) from exc
    members = []
    for actor, slot, cap, pid in zip(actors, slots, caps, pids, strict=True):
        say(f"[{slot.name}] Ray actor pid {pid} on node {slot.node_ip}")
        members.append(
            Member(
                f"{socket.gethostname()}:{os.getpid()}:{slot.name}",
                slot.name,
                Capabilities.model_validate_json(cap),
                RayLaunch(ray, actor, slot.name, stopping),
                lambda actor=actor: _close(ray, actor),
                lambda actor=actor: _answers(ray, actor),
            )
        )
    return actors, members


def check_head(ray: Any, grace_s: float = 0.0) -> None:
    """Raise ClusterLost when the cluster's head (its GCS) refuses a TCP connection, now or
    within `grace_s`. Asked when an actor stops answering: without it a lost head would look
    like a dead actor (an attempt spent per job) until Ray's own client ends this process
    after 60 s with a C++ log line instead of ours."""
    address = ray.get_runtime_context().gcs_address
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + grace_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=HEAD_TIMEOUT_S).close()
        except OSError as exc:
            raise ClusterLost(
                f"lost the Ray cluster: its head at {address} does not answer "
                f"({exc.strerror or exc}); running jobs went back to the queue"
            ) from None
        if time.monotonic() >= deadline:
            return
        time.sleep(0.5)


def quiet_cluster_notices(ray: Any) -> None:
    """Ray's driver prints every error its cluster publishes, a lost node's as a 20-line
    dump of the raylet's log, to stdout. Keep one line of each, on stderr; a node's death
    is left out altogether, as the pool says what it did to its jobs (`died mid-job`, or the
    cluster lost). Ray's private printer is replaced only where it exists (2.40-2.60 have it);
    elsewhere Ray prints as it does."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    if worker is None or not callable(getattr(worker, "print_to_stdstream", None)):
        return

    def one_line(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        lines = [str(x) for x in data.get("lines", ()) if str(x).strip()]
        if not lines or "Raylet is terminated" in lines[0]:
            return
        print(f"ray ({data.get('pid', '?')}): {first_line(lines[0])}", file=sys.stderr)

    worker.print_to_stdstream = one_line


def _answers(ray: Any, actor: Any) -> bool:
    """Whether the actor takes calls, waiting out a restart (Ray restarts a dead actor up to
    MAX_RESTARTS times); False once it is gone for good. ClusterLost when the head is."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while time.monotonic() < deadline:
        check_head(ray)
        try:
            ray.get(actor.pid.remote(), timeout=RESTART_WAIT_S)
            return True
        except ray.exceptions.ActorDiedError:
            return False
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)  # restarting
    return False


def _close(ray: Any, actor: Any) -> None:
    try:
        check_head(ray)
    except ClusterLost:
        return  # nothing to close: a call would wait out its timeout for nobody
    with contextlib.suppress(Exception):  # dead already
        ray.get(actor.close.remote(), timeout=30)
    with contextlib.suppress(Exception):
        ray.kill(actor, no_restart=True)


def _run(
    store: Any,
    members: list[Member],
    runs_dir: Path,
    pool_id: str,
    lock_id: str,
    stopping: threading.Event,
    *,
    track: bool,
    exit_when_idle: bool,
    cadence: Cadence,
    say: Say,
) -> int:
    """One thread per member (serve); this thread beats for the pool and waits."""
    results: dict[str, int | BaseException] = {}

    def member_main(m: Member) -> None:
        try:
            results[m.slot] = serve(store, m, runs_dir, pool_id, track=track,
                                    exit_when_idle=exit_when_idle, cadence=cadence, say=say,
                                    stop=stopping)  # fmt: skip
        except BaseException as exc:  # ClusterLost, a store that went away: said below
            results[m.slot] = exc
            stopping.set()

    threads = [threading.Thread(target=member_main, args=(m,), name=m.slot) for m in members]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(cadence.poll_s)
            store.beat(lock_id)
    except KeyboardInterrupt:
        say("stopping the pool: running jobs go back to the queue")
        stopping.set()
        return 130
    except BaseException:  # the database went away: the members stop after their job
        stopping.set()
        raise
    failures = [r for r in results.values() if isinstance(r, BaseException)]
    if failures:
        say(f"the pool stopped: {first_line(failures[0])}")
        return 1
    return 1 if any(r != 0 for r in results.values()) else 0
