"""The Ray backend (running.ray_pool, `orchestrate workers --backend ray`).

The end-to-end test starts a real Ray cluster in the pool's process (`--address local`,
two CPU slots as the custom resource `orchestrate_cpu_slot`), runs six tiny jobs and kills
one slot's actor with SIGKILL mid-job: Ray restarts the actor, the queue re-runs the job,
and every job is stored once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from factories import run_cli, submit_seeded

from orchestrate.api.config import LengthPolicy, ModelSpec, Prompt, StackSpec, Workload
from orchestrate.api.protocol import load_protocol
from orchestrate.api.records import JobSpec
from orchestrate.api.scheduling import Capabilities
from orchestrate.running import ray_actor, ray_pool
from orchestrate.running.executor import Submission, run_claimed
from orchestrate.running.plan import plan_job
from orchestrate.running.runner import WorkerLost
from orchestrate.store.store import Store

pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")
# The tests that start a Ray cluster run alone (CI's serial pass): its processes want the
# whole machine. The rest (fakes, a refused address, no ray package) run in the parallel pass.
cluster = pytest.mark.serial

CPU = Capabilities(device="cpu", families=("rumik",))
TINY = Workload(
    name="q",
    prompts=[Prompt(id="a", text="A short sentence.")],
    seeds=[42],
    warmups=0,
    length_policy={"mode": "fixed", "frames": 4},
    save_audio=0,
)


def job(tmp_path: Path) -> JobSpec:
    return plan_job(
        ModelSpec(preset="tiny", device="cpu"), TINY, [StackSpec(name="stock")],
        load_protocol("protocol"), tmp_path / "runs", fidelity_steps=0, check_device=False,
    )  # fmt: skip


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e")
    with Store(f"sqlite:///{tmp_path / 'o.db'}") as s:
        yield s


# ------------------------------------------------------------------- shipping folders


def test_job_folders_travel_with_their_paths_rewritten_and_never_leave_their_folder(
    tmp_path: Path,
) -> None:
    node, driver = tmp_path / "node" / "job1", tmp_path / "driver" / "job1"
    (node / "stock").mkdir(parents=True)
    (node / "result.json").write_text(json.dumps({"output_dir": str(node), "n": 1}))
    (node / "stock" / "a_s1.wav").write_bytes(b"RIFF" + str(node).encode())  # binary: as is
    files = ray_actor.pack(node, str(node), str(driver))
    assert json.loads(files["result.json"])["output_dir"] == str(driver)
    assert files["stock/a_s1.wav"] == b"RIFF" + str(node).encode()
    ray_actor.unpack(driver, files, "", "")
    assert json.loads((driver / "result.json").read_text())["output_dir"] == str(driver)
    assert (driver / "stock" / "a_s1.wav").exists()
    with pytest.raises(ValueError, match="outside"):
        ray_actor.unpack(driver, {"../../escaped.txt": b"x"}, "", "")
    assert not (tmp_path / "escaped.txt").exists()


# ---------------------------------------------------------------------- the cluster


class FakeRay:
    def __init__(self, *resources: dict[str, float]) -> None:
        self._nodes = [
            {"Alive": True, "NodeID": f"n{i}", "NodeManagerAddress": f"10.0.0.{i}",
             "Resources": r}
            for i, r in enumerate(resources)
        ]  # fmt: skip

    def nodes(self) -> list[dict[str, Any]]:
        return self._nodes


def test_slots_come_from_what_the_cluster_offers() -> None:
    gpus = FakeRay({"GPU": 2, "accelerator_type:H200": 1}, {"GPU": 1}, {"CPU": 8})
    assert [s.name for s in ray_pool.cluster_slots(gpus, "all")] == [
        "ray:10.0.0.0:gpu0", "ray:10.0.0.0:gpu1", "ray:10.0.0.1:gpu0",
    ]  # fmt: skip
    cpus = FakeRay({ray_pool.CPU_SLOT: 1}, {ray_pool.CPU_SLOT: 2})
    assert len(ray_pool.cluster_slots(cpus, "cpu:3")) == 3
    with pytest.raises(ray_pool.RayUnavailable, match="offers 3 CPU slots"):
        ray_pool.cluster_slots(cpus, "cpu:4")
    with pytest.raises(ray_pool.RayUnavailable, match="no GPU"):
        ray_pool.cluster_slots(cpus, "all")
    with pytest.raises(ray_pool.RayUnavailable, match="use all .* or cpu:N"):
        ray_pool.cluster_slots(gpus, "0,1")
    assert ray_pool.describe_cluster(gpus)[0]["gpu_type"] == "H200"


# ------------------------------------------------------------------- a lost worker


def test_a_lost_worker_requeues_its_job_recording_each_attempt_then_fails_it(
    store: Any, tmp_path: Path
) -> None:
    """WorkerLost (a Ray actor died with the job): the run is INTERRUPTED, the job goes
    back to the queue with the attempt in its history, and FAILED after max_attempts."""

    def dies(job_path: Path, result_path: Path, log_path: Path, on_event: Any) -> int:
        raise WorkerLost("Ray actor ray:x:cpu0 died mid-job: killed")

    job_id = store.enqueue(job(tmp_path), Submission(job(tmp_path)).requirements(),
                           max_attempts=2)  # fmt: skip
    for attempt in (1, 2):
        claim = store.claim_job("w", CPU)
        assert claim is not None and claim.attempt == attempt
        with pytest.raises(WorkerLost):
            run_claimed(store, claim, tmp_path / "runs", dies, track=False)
        assert store.get_job(job_id)["state"] == ("PENDING" if attempt == 1 else "FAILED")
    row = store.get_job(job_id)
    assert "failed after 2 attempts" in row["error"] and "died mid-job" in row["error"]
    assert [r["status"] for r in store.list_runs()] == ["INTERRUPTED", "INTERRUPTED"]


# ------------------------------------------------------------------- bad input


def test_a_ray_address_that_does_not_answer_is_one_line_and_claims_nothing(
    tmp_path: Path,
) -> None:
    env = os.environ | {"ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    wl = tmp_path / "wl.yaml"
    wl.write_text(TINY.model_dump_json())
    sub = run_cli(["submit", "--stack", "cpu-fast", "--workload", str(wl),
                   "--fidelity-steps", "0", "--json"], env, tmp_path)  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    out = run_cli(["workers", "--backend", "ray", "--address", "127.0.0.1:9", "--gpus", "all"],
                  env, tmp_path)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: the Ray cluster at 127.0.0.1:9 does not answer (Connection refused): start "
        "its head with `ray start --head --port 9`, or pass the right --address"
    ]
    with Store(env["ORCHESTRATE_DB_URL"]) as s:
        (queued,) = s.list_jobs()
    assert queued["state"] == "PENDING" and queued["attempts"] == 0


def test_without_the_ray_package_the_backend_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['ray'] = None; "  # as if ray were not installed
        "from orchestrate.cli.app import app; "
        f"sys.argv = ['orchestrate', 'workers', '--backend', 'ray', '--gpus', 'cpu:1', "
        f"'--db', 'sqlite:///{tmp_path / 'o.db'}']; app()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "error: the Ray backend needs the ray package: pip install 'orchestrate[ray]'"
    )


# ----------------------------------------------------------------- end to end


def local_ray_pool(env: dict[str, str], cwd: Path, slots: int) -> subprocess.Popen[str]:
    """`orchestrate workers --backend ray` on a local cluster of `slots` CPU slots, draining
    the queue until it is empty; stdout and stderr together."""
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", "workers", "--backend", "ray",
         "--address", "local", "--gpus", f"cpu:{slots}", "--exit-when-idle", "--no-mlflow",
         "--poll", "0.2", "--heartbeat", "0.5"],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@cluster
@pytest.mark.slow
def test_a_ray_pool_runs_six_jobs_once_each_and_survives_a_killed_actor(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'o.db'}"
    env = os.environ | {"ORCHESTRATE_DB_URL": db, "ORCHESTRATE_CODE_SHA": "7" * 40}
    ids = submit_seeded(TINY, range(6), env, tmp_path)
    t0 = time.monotonic()
    pool = local_ray_pool(env, tmp_path, slots=2)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(pool.stdout or ()), daemon=True)
    reader.start()
    victim = None
    with Store(db) as store:
        deadline = time.monotonic() + 300
        while victim is None and time.monotonic() < deadline:
            pids = dict(re.findall(r"\[(ray:\S+)\] Ray actor pid (\d+)", "".join(lines)))
            running = [j for j in store.list_jobs(("RUNNING",)) if j["progress"]]
            if running and pids:
                victim = running[0]
                os.kill(int(pids[victim["worker_id"].split(":", 2)[2]]), signal.SIGKILL)
            time.sleep(0.1)
        assert victim is not None, "no job started within 300 s: " + "".join(lines)
        pool.wait(timeout=900)
        wall = time.monotonic() - t0
        reader.join(timeout=10)
        output = "".join(lines)
        assert pool.returncode == 0, output
        jobs = {j["id"]: j for j in store.list_jobs()}
        runs = store.list_runs(limit=100)
    assert {jobs[i]["state"] for i in ids} == {"DONE"}, output
    killed = jobs[victim["id"]]
    assert killed["attempts"] == 2 and "died mid-job" in json.dumps(killed["history"]), output
    finished = Counter(r["job_id"].split("-r")[0] for r in runs if r["status"] == "FINISHED")
    assert finished == Counter(ids)  # each job stored once
    interrupted = [r["job_id"] for r in runs if r["status"] == "INTERRUPTED"]
    assert interrupted == [victim["id"]]
    assert "goes back to the queue" in output
    spans = sorted((j["claimed_at"], j["finished_at"]) for j in jobs.values())
    busy = sum((end - start).total_seconds() for start, end in spans)
    print(f"six jobs on a Ray cluster of two CPU slots: wall {wall:.1f} s, jobs {busy:.1f} s")


@cluster
@pytest.mark.slow
def test_a_cancelled_job_stops_its_worker_on_the_actors_node(tmp_path: Path) -> None:
    """`orchestrate cancel` of a running job reaches the worker inside a Ray actor (the
    driver cannot signal a process on another node: the actor does): the job is CANCELLED
    within seconds instead of running to its end, and nothing of it is recorded."""
    db = f"sqlite:///{tmp_path / 'o.db'}"
    env = os.environ | {"ORCHESTRATE_DB_URL": db, "ORCHESTRATE_CODE_SHA": "7" * 40}
    # eight clips of 1900 frames (the tiny model holds 2048 positions): minutes of decoding
    prompts = [Prompt(id=f"p{i}", text="A short sentence.") for i in range(8)]
    policy = LengthPolicy(mode="fixed", frames=1900)
    long = TINY.model_copy(update={"prompts": prompts, "length_policy": policy})
    (job_id,) = submit_seeded(long, range(1), env, tmp_path)
    pool = local_ray_pool(env, tmp_path, slots=1)
    with Store(db) as store:
        deadline = time.monotonic() + 300
        while not store.get_job(job_id)["progress"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert store.get_job(job_id)["progress"], "the job did not start within 300 s"
        time.sleep(2)  # into its decoding
        cancelled = run_cli(["cancel", job_id], env, tmp_path)
        assert cancelled.returncode == 0, cancelled.stderr
        t0 = time.monotonic()
        output, _ = pool.communicate(timeout=300)
        stopped_s = time.monotonic() - t0
        row = store.get_job(job_id)
        runs = store.list_runs(limit=10)
    assert pool.returncode == 0, output
    assert row["state"] == "CANCELLED", (row, output)
    assert not [r for r in runs if r["status"] == "FINISHED"], runs
    assert stopped_s < 60, f"the pool took {stopped_s:.0f} s to stop after cancel:\n{output}"


@cluster
def test_the_ray_backend_lists_the_clusters_nodes(tmp_path: Path) -> None:
    """No --gpus: the cluster's nodes with their GPUs and CPU slots (a local cluster here)."""
    env = os.environ | {"ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    out = run_cli(["workers", "--backend", "ray", "--address", "local", "--json"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    (node,) = json.loads(out.stdout)
    assert node["gpus"] == 0 and node["cpu_slots"] == 0 and node["workers"] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@cluster
@pytest.mark.slow
def test_a_lost_head_stops_the_pool_with_one_line_and_requeues_its_job(tmp_path: Path) -> None:
    """A pool joined to a cluster (`ray start --head`, then --address HOST:PORT) whose head
    goes away mid-job (`ray stop --force`): one line, exit 1, and the job PENDING again with
    no attempt spent and nothing recorded as done. Before the head check the driver printed
    the raylet's 20-line log dump, spent an attempt, and was ended by Ray's own client after
    60 s with a C++ log line."""
    db = f"sqlite:///{tmp_path / 'o.db'}"
    env = os.environ | {"ORCHESTRATE_DB_URL": db, "ORCHESTRATE_CODE_SHA": "7" * 40}
    policy = LengthPolicy(mode="fixed", frames=1900)  # minutes of decoding: cut mid-job
    (job_id,) = submit_seeded(TINY.model_copy(update={"length_policy": policy}), range(1),
                              env, tmp_path)  # fmt: skip
    port, ray_bin = _free_port(), str(Path(sys.executable).with_name("ray"))
    head = subprocess.run(
        [ray_bin, "start", "--head", "--port", str(port), "--num-cpus", "2",
         "--resources", json.dumps({ray_pool.CPU_SLOT: 1}), "--include-dashboard", "false",
         "--disable-usage-stats"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert head.returncode == 0, head.stderr
    try:
        pool = subprocess.Popen(
            [sys.executable, "-m", "orchestrate.cli", "workers", "--backend", "ray",
             "--address", f"127.0.0.1:{port}", "--gpus", "cpu:1", "--exit-when-idle",
             "--no-mlflow", "--poll", "0.2", "--heartbeat", "0.5"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with Store(db) as store:
            deadline = time.monotonic() + 300
            while not store.get_job(job_id)["progress"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert store.get_job(job_id)["progress"], "the job did not start within 300 s"
    finally:
        subprocess.run([ray_bin, "stop", "--force"], capture_output=True, timeout=120)
    t0 = time.monotonic()
    out, err = pool.communicate(timeout=120)
    stopped_s = time.monotonic() - t0
    assert pool.returncode == 1, (out, err)
    said = [line for line in out.splitlines() if not line.startswith("[ray:")]  # its slot's log
    lost = "the pool stopped: lost the Ray cluster: its head at "
    assert len(said) == 1 and said[0].startswith(lost), out
    assert err == "", err  # no raylet dump, no C++ log line
    assert stopped_s < 30, f"{stopped_s:.0f} s to stop"
    with Store(db) as store:
        row = store.get_job(job_id)
        runs = store.list_runs(limit=10)
    assert row["state"] == "PENDING" and row["attempts"] == 0, row
    assert not [r for r in runs if r["status"] == "FINISHED"], runs
