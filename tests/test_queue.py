"""The job queue, the executors and the worker pool (store.queue, running.executor,
running.pool, `orchestrate submit/queue/cancel/workers`).

Store-level tests use fabricated results (no model); one end-to-end test runs a CPU pool of
two workers over six tiny jobs and kills one worker mid-job with SIGKILL.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from factories import fabricate_result, run_cli, submit_seeded
from pydantic import ValidationError

from orchestrate.api.config import ModelSpec, Prompt, StackSpec, Workload
from orchestrate.api.protocol import load_protocol
from orchestrate.api.records import JobSpec
from orchestrate.api.scheduling import Capabilities, Requirements, why_not
from orchestrate.running.executor import (
    LocalExecutor,
    PoolExecutor,
    Submission,
    run_claimed,
    submit,
)
from orchestrate.running.plan import plan_job
from orchestrate.running.pool import parse_slots
from orchestrate.store.queue import ClaimLost, PoolRefused
from orchestrate.store.store import Store

CPU = Capabilities(device="cpu", families=("rumik",))
H200 = Capabilities(
    device="cuda", gpu_name="NVIDIA H200", gpu_memory_gb=143.8, capability=(9, 0),
    families=("rumik",),
)  # fmt: skip
TINY = Workload(
    name="q",
    prompts=[Prompt(id="a", text="A short sentence.")],
    seeds=[42],
    warmups=0,
    length_policy={"mode": "fixed", "frames": 4},
    save_audio=0,
)


@pytest.fixture
def store(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh store: a SQLite file, then a PostgreSQL database (tests/pg_server.py)."""
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e")
    with Store(db_url) as s:
        yield s


def job(tmp_path: Path, device: str = "cpu", seed: int = 42) -> JobSpec:
    wl = TINY.model_copy(update={"seeds": [seed]})
    return plan_job(
        ModelSpec(preset="tiny", device=device), wl, [StackSpec(name="stock")],
        load_protocol("protocol"), tmp_path / "runs", fidelity_steps=0, check_device=False,
    )  # fmt: skip


def fake_worker(job_path: Path, result_path: Path, log_path: Path, on_event: Any) -> int:
    """A worker launch that 'measures' instantly: a fabricated result for the job's id."""
    spec = JobSpec.model_validate_json(job_path.read_text())
    on_event({"event": "status", "message": "measuring (fake)"})
    result_path.write_text(fabricate_result(job_id=spec.job_id).model_dump_json())
    log_path.write_text("")
    return 0


# ------------------------------------------------------------------ requirements


def test_requirements_route_jobs_to_workers_that_can_run_them() -> None:
    cuda = Requirements(family="rumik", device="cuda", sm90=True, min_gpu_memory_gb=100)
    assert why_not(cuda, H200) is None
    assert why_not(cuda, CPU) == "needs a cuda worker"
    a100 = H200.model_copy(update={"gpu_name": "A100", "capability": (8, 0)})
    assert why_not(cuda, a100) == "needs a Hopper GPU (sm_90)"
    assert "200 GB" in str(why_not(cuda.model_copy(update={"min_gpu_memory_gb": 200}), H200))
    assert why_not(cuda.model_copy(update={"gpu_model": "B200"}), H200) == "needs a B200 GPU"
    newer = Requirements(family="rumik", device="cpu", schema_version=99)
    assert "schema version 99 is newer" in str(why_not(newer, CPU))
    assert "not installed" in str(why_not(Requirements(family="x", device="cpu"), CPU))


def test_parse_slots_refuses_what_is_not_here() -> None:
    assert [s.name for s in parse_slots("cpu:2", lambda: 0)] == ["cpu:0", "cpu:1"]
    assert [s.visible for s in parse_slots("0,1", lambda: 2)] == ["0", "1"]
    assert [s.visible for s in parse_slots("cpu:1", lambda: 2)] == [""]  # sees no GPU
    for bad, gpus, why in [
        ("all", 0, "no CUDA GPU"),
        ("2", 1, "GPU 2 is not here"),
        ("0,0", 1, "distinct"),
        ("cpu:0", 0, "between 1 and 64"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_slots(bad, lambda n=gpus: n)


# ------------------------------------------------------------------------ claims


def test_concurrent_claims_take_each_job_once(store: Any, tmp_path: Path) -> None:
    ids = {store.enqueue(job(tmp_path, seed=s), Requirements(family="rumik", device="cpu"))
           for s in range(40, 56)}  # fmt: skip
    url = store.url
    taken: list[tuple[str, str]] = []

    def drain(n: int) -> None:
        with Store(url) as mine:  # its own engine and connections, like another process
            while (claim := mine.claim_job(f"w{n}", CPU)) is not None:
                taken.append((claim.job_id, f"w{n}"))

    threads = [threading.Thread(target=drain, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(j for j, _ in taken) == Counter(ids)  # every job, each exactly once
    assert store.claim_job("late", CPU) is None


def test_a_job_no_worker_can_run_stays_pending_with_its_reason(store: Any, tmp_path: Path) -> None:
    store.enqueue(job(tmp_path, device="cuda"), Requirements(family="rumik", device="cuda"))
    assert store.claim_job("cpu-worker", CPU) is None
    store.register_worker("vm:1:cpu:0", "pool1", "cpu:0", CPU)
    from orchestrate.cli.queue import _why_pending

    (row,) = store.list_jobs()
    assert row["state"] == "PENDING"
    assert _why_pending(row, store.live_workers()) == (
        "no live worker can run it: needs a cuda worker"
    )


def test_priority_first_then_oldest(store: Any, tmp_path: Path) -> None:
    req = Requirements(family="rumik", device="cpu")
    low = store.enqueue(job(tmp_path, seed=1), req)
    high = store.enqueue(job(tmp_path, seed=2), req, priority=5)
    assert store.claim_job("w", CPU).job_id == high
    assert store.claim_job("w", CPU).job_id == low


def test_the_longest_job_id_fits_the_store_with_its_attempt_suffix(
    store: Any, tmp_path: Path
) -> None:
    """Job ids are kept in 64 characters, which PostgreSQL enforces: the longest id a job may
    have, with a re-queued attempt's suffix, is stored whole; one longer is refused when the
    job is read, before anything is queued."""
    longest = "j" * 56
    for job_id in (longest, f"{longest}-r99"):
        queued = store.enqueue(job(tmp_path).model_copy(update={"job_id": job_id}),
                               Requirements(family="rumik", device="cpu"))  # fmt: skip
        assert queued == job_id and store.get_job(job_id)["state"] == "PENDING"
    too_long = job(tmp_path).model_dump(mode="json") | {"job_id": "j" * 57}
    with pytest.raises(ValidationError, match="job_id"):
        JobSpec.model_validate(too_long)


def test_recording_needs_the_claim(store: Any, tmp_path: Path) -> None:
    """A worker whose job was re-queued (thought dead) cannot record it: nothing written."""
    queued = store.enqueue(job(tmp_path), Requirements(family="rumik", device="cpu"))
    first = store.claim_job("slow", CPU)
    store.cancel_job(queued)  # stands in for any loss of the claim
    with pytest.raises(ClaimLost, match="no longer held by slow"):
        store.finish_claimed(first, "no-such-run", fabricate_result(job_id=queued))
    assert store.get_job(queued)["state"] == "CANCELLED"
    assert store.count("runs") == 0


def test_a_dead_workers_job_is_requeued_then_failed_with_its_attempts(
    store: Any, tmp_path: Path
) -> None:
    queued = store.enqueue(job(tmp_path), Requirements(family="rumik", device="cpu"),
                           max_attempts=2)  # fmt: skip
    for attempt in (1, 2):
        dead = f"{store.hostname}:{_dead_pid()}:cpu:0"
        store.register_worker(dead, "p", "cpu:0", CPU)
        with store._write() as s:  # the row as a worker that has since died wrote it
            from orchestrate.db.models import PoolWorker

            s.get(PoolWorker, dead).pid = int(dead.split(":")[1])
        claim = store.claim_job(dead, CPU)
        assert claim is not None and claim.attempt == attempt
        assert store.reap_dead() == [queued]
    row = store.get_job(queued)
    assert row["state"] == "FAILED"
    assert row["error"].startswith("failed after 2 attempts (attempt 1 on ")
    assert "is gone" in row["error"] and store.live_workers() == []


def test_one_pool_per_database(store: Any) -> None:
    store.register_worker(f"{store.hostname}:{os.getpid()}:pool", "first", "pool", CPU, lock=True)
    with pytest.raises(PoolRefused, match="a worker pool already drains this database"):
        store.register_worker("other:1:pool", "second", "pool", CPU, lock=True)


# --------------------------------------------------------------------- executors


def test_local_executor_records_each_job_once_through_the_queue(store: Any, tmp_path: Path) -> None:
    jobs = [Submission(job(tmp_path, seed=s)) for s in (1, 2)]
    ex = LocalExecutor(store, tmp_path / "runs", track=False, worker=fake_worker)
    outcomes = submit(ex, jobs)
    assert [o.result.job.job_id for o in outcomes] == [s.job.job_id for s in jobs]
    rows = {r["id"]: r for r in store.list_jobs()}
    for sub, out in zip(jobs, outcomes, strict=True):
        assert rows[sub.job.job_id]["state"] == "DONE"
        assert rows[sub.job.job_id]["run_id"] == out.run_id
    assert store.count("runs") == 2


def test_pool_executor_yields_outcomes_as_a_worker_finishes_them(
    store: Any, tmp_path: Path
) -> None:
    subs = [Submission(job(tmp_path, seed=s)) for s in (1, 2, 3)]
    seen: list[dict[str, Any]] = []
    ex = PoolExecutor(store, on_event=seen.append, poll_s=0.05, slots=1)

    order: list[int] = []
    # The waiting side in a thread; the worker in the main thread, as in a pool member
    # (execute installs a SIGTERM handler, which only the main thread may).
    waiter = threading.Thread(target=lambda: order.extend(i for i, _ in ex.run(subs)))
    waiter.start()
    done, deadline = 0, time.monotonic() + 60
    while done < 3 and time.monotonic() < deadline:
        claim = store.claim_job("t:1:cpu:0", CPU)
        if claim is None:
            time.sleep(0.02)
            continue
        run_claimed(store, claim, tmp_path / "runs", fake_worker, track=False, beat_s=0.05)
        done += 1
    waiter.join(timeout=30)
    assert sorted(order) == [0, 1, 2]
    assert {r["state"] for r in store.list_jobs()} == {"DONE"}
    assert store.count("runs") == 3


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --------------------------------------------------------------------------- CLI


def test_bad_submissions_fail_at_submit_and_queue_nothing(tmp_path: Path) -> None:
    env = os.environ | {"ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'o.db'}"}
    bad = run_cli(["submit", "--stack", "no-such-stack"], env, tmp_path)
    assert bad.returncode == 2 and "no-such-stack" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = run_cli(["submit", "--stack", "cpu-fast", "--min-gpu-memory", "0"], env, tmp_path)
    assert bad.returncode == 2 and "--min-gpu-memory must be > 0" in bad.stderr
    empty = run_cli(["queue"], env, tmp_path)
    assert empty.returncode == 0 and "the queue is empty" in empty.stdout
    gone = run_cli(["cancel", "abc"], env, tmp_path)
    assert gone.returncode == 2 and "no queued job 'abc'" in gone.stderr


def test_a_worker_that_cannot_reach_its_database_claims_nothing(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'missing' / 'dir' / 'o.db'}"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate.running.pool", "--db", url, "--runs-dir",
         str(tmp_path), "--pool-id", "p", "--slot", "cpu:0", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("[cpu:0] ") and "missing" in line


# -------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_cpu_pool_runs_six_jobs_once_each_and_survives_a_killed_worker(tmp_path: Path) -> None:
    """Six tiny jobs, `workers --gpus cpu:2 --exit-when-idle`; the first worker to hold a
    job is killed with SIGKILL: its job re-runs (attempt 2) and every job is stored once."""
    import subprocess
    import sys

    db = f"sqlite:///{tmp_path / 'o.db'}"
    env = os.environ | {"ORCHESTRATE_DB_URL": db, "ORCHESTRATE_CODE_SHA": "6" * 40}
    ids = submit_seeded(TINY, range(6), env, tmp_path)
    t0 = time.monotonic()
    pool = subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", "workers", "--gpus", "cpu:2",
         "--exit-when-idle", "--no-mlflow", "--poll", "0.2", "--heartbeat", "0.5"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    victim = None
    with Store(db) as store:
        deadline = time.monotonic() + 300
        while victim is None and time.monotonic() < deadline:
            running = [j for j in store.list_jobs(("RUNNING",)) if j["progress"]]
            if running:
                victim = running[0]
                os.kill(int(victim["worker_id"].split(":")[1]), signal.SIGKILL)
            time.sleep(0.1)
        assert victim is not None, "no job started within 300 s"
        output, _ = pool.communicate(timeout=900)
        wall = time.monotonic() - t0
        assert pool.returncode == 0, output
        jobs = {j["id"]: j for j in store.list_jobs()}
        runs = store.list_runs(limit=100)
    assert {jobs[i]["state"] for i in ids} == {"DONE"}, output
    killed = jobs[victim["id"]]
    assert killed["attempts"] == 2 and "is gone" in json.dumps(killed["history"])
    assert killed["history"][-1]["worker"] != victim["worker_id"]
    # Stored once: one recorded run per job; the killed attempt's run is INTERRUPTED.
    finished = Counter(r["job_id"].split("-r")[0] for r in runs if r["status"] == "FINISHED")
    assert finished == Counter(ids)
    interrupted = [r for r in runs if r["status"] == "INTERRUPTED"]
    assert [r["job_id"] for r in interrupted] == [victim["id"]]
    assert "restarting it (1/3)" in output
    # Two workers ran at once: some two jobs' claimed..finished intervals overlap.
    spans = sorted((j["claimed_at"], j["finished_at"]) for j in jobs.values())
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), spans
    busy = sum((end - start).total_seconds() for start, end in spans)
    print(f"six jobs on cpu:2: wall {wall:.1f} s, sum of job times {busy:.1f} s")
