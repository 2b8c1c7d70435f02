"""Injected faults: a worker killed in each phase, the orchestrator killed or terminated, a
full disk. Each ends with one clear line, a run row that is FAILED or INTERRUPTED (never
RUNNING) with the cause as a fact, the job folder on disk, and every utterance measured
before the fault kept in utterances.jsonl, from which `--resume` recovers it.

The worker's faults come from its test hook, ORCHESTRATE_FAULT (read only by the worker):
kill_at:PHASE (SIGKILL) and enospc_at:PHASE (OSError ENOSPC). Runs use the tiny model,
2 prompts x 1 seed, 4 frames, 4 fidelity steps, no MLflow: ~15-25 s each on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from factories import run_cli as cli

from orchestrate.store.store import Store

WORKLOAD = """\
name: faults
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 1
length_policy: {mode: fixed, frames: 4}
save_audio: 1
"""
# stock alone: the cheapest run that goes through every phase
RUN = ["run", "--stack", "stock", "--workload", "wl.yaml", "--fidelity-steps", "4", "--no-mlflow"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    (tmp_path / "long.yaml").write_text(WORKLOAD.replace("[42]", "[42, 43, 44, 45]"))
    return {
        **os.environ,
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        # Pinned so a resume is not refused because others edit this tree meanwhile.
        "ORCHESTRATE_CODE_SHA": "fa17fa17fa17fa17fa17fa17fa17fa17fa17fa17",
        "PYTHONUNBUFFERED": "1",
    }


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def only_run(env: dict[str, str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The one run row (opening the store reconciles a dead owner's run) and its ledger."""
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        (row,) = store.list_runs()
        return row, [f for f in store.list_failures() if f["run_id"] == row["id"]]


def journal(job_dir: Path) -> dict[tuple[str, str, int], float]:
    """utterances.jsonl as {(stack, prompt, seed): latency}."""
    path = job_dir / "utterances.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {
        (r["stack"], r["utterance"]["prompt_id"], r["utterance"]["seed"]): r["utterance"][
            "latency_s"
        ]
        for r in rows
    }


def resume_recovers(env: dict[str, str], tmp_path: Path, run_id: str, kept: dict) -> None:
    """`--resume` finishes the run and carries every kept utterance, unchanged."""
    out = cli(["run", "--resume", run_id[:8], "--no-mlflow", "--json"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["resumed_from"] == run_id
    carried = {
        (s["name"], u["prompt_id"], u["seed"]): u["latency_s"]
        for s in run["stacks"]
        for u in s["utterances"]
        if u["resumed"]
    }
    assert carried == kept


# ---------------------------------------------------------------- the worker, killed


@pytest.mark.parametrize(
    ("phase", "measured"),
    [
        ("build", 0),
        ("warmup", 0),
        ("fidelity", 0),
        ("timing", 1),  # after the first utterance is in utterances.jsonl
        pytest.param("result_write", 2, marks=pytest.mark.slow),
    ],
)
def test_worker_killed_in_a_phase(
    env: dict[str, str], tmp_path: Path, phase: str, measured: int
) -> None:
    proc = cli(RUN, {**env, "ORCHESTRATE_FAULT": f"kill_at:{phase}"}, tmp_path)
    assert proc.returncode == 1, proc.stderr
    line = one_line(proc.stderr)
    assert "failed: worker killed by SIGKILL (worker log: " in line, line
    assert "out of memory" not in line  # a SIGKILL alone says nothing about memory

    row, ledger = only_run(env)
    assert row["status"] == "FAILED" and row["error"].startswith("worker killed by SIGKILL")
    assert [f["cause"] for f in ledger] == ["crash"]  # a fact, not a guess at OOM
    (job_dir,) = (tmp_path / "runs").iterdir()
    assert (job_dir / "job.json").is_file() and (job_dir / "worker.log").is_file()
    assert not (job_dir / "result.json").exists()
    kept = journal(job_dir)
    assert len(kept) == measured
    if measured:
        assert f"{measured} measured utterances kept: orchestrate run --resume" in line
    if phase == "timing":
        resume_recovers(env, tmp_path, row["id"], kept)


# ---------------------------------------------------------------- the orchestrator


def _start(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """`orchestrate run` on 2 prompts x 4 seeds, returned once one utterance is on disk."""
    args = [*RUN[:4], "long.yaml", *RUN[5:]]
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list((tmp_path / "runs").glob("*/utterances.jsonl"))
        if found and found[0].read_text().strip():
            return proc, found[0].parent
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no utterance was measured\n{proc.communicate()[1]}")


def _worker_pid(job_dir: Path) -> int:
    return int((job_dir / "worker.pid").read_text())  # written by the runner's spawn_worker


def _gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_orchestrator_killed_is_interrupted_on_the_next_command(
    env: dict[str, str], tmp_path: Path
) -> None:
    proc, job_dir = _start(env, tmp_path)
    proc.kill()  # SIGKILL: no handler runs, the row is left RUNNING
    proc.communicate(timeout=60)
    assert _gone(_worker_pid(job_dir))  # the worker dies with it, holding nothing
    runs = cli(["runs", "--json"], env, tmp_path)  # the next command notices
    (row,) = json.loads(runs.stdout)
    assert row["status"] == "INTERRUPTED"
    host = socket.gethostname()
    assert row["error"] == f"orchestrator process {proc.pid} on {host} ended without finishing"
    _, ledger = only_run(env)
    assert [f["cause"] for f in ledger] == ["interrupted"]
    kept = journal(job_dir)
    assert kept and (job_dir / "job.json").is_file()
    resume_recovers(env, tmp_path, row["id"], kept)


def test_orchestrator_terminated_is_interrupted_exit_130(
    env: dict[str, str], tmp_path: Path
) -> None:
    proc, job_dir = _start(env, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    row, ledger = only_run(env)
    assert one_line(stderr) == (
        "error: interrupted (orchestrator received SIGTERM); the run is marked INTERRUPTED"
    )
    assert row["status"] == "INTERRUPTED" and row["error"] == "orchestrator received SIGTERM"
    assert [f["cause"] for f in ledger] == ["interrupted"]
    assert _gone(_worker_pid(job_dir))
    assert journal(job_dir) and (job_dir / "job.json").is_file()


# ---------------------------------------------------------------- a full disk


@pytest.mark.slow
def test_full_disk_at_the_result_is_one_line_and_loses_no_utterance(
    env: dict[str, str], tmp_path: Path
) -> None:
    proc = cli(RUN, {**env, "ORCHESTRATE_FAULT": "enospc_at:result_write"}, tmp_path)
    assert proc.returncode == 1, proc.stderr
    row, ledger = only_run(env)
    (job_dir,) = (tmp_path / "runs").iterdir()
    folder = job_dir.absolute()
    line = one_line(proc.stderr)
    assert line.startswith(
        f"error: run {row['id'][:12]} failed: worker exited with status 1: no space left on "
        f"device writing {folder}/result.json (folder {folder}: "
    ), line
    assert " GB free)" in line and line.endswith(
        f"2 measured utterances kept: orchestrate run --resume {row['id'][:12]} continues"
    )
    assert row["status"] == "FAILED" and "no space left on device" in row["error"]
    assert [f["cause"] for f in ledger] == ["crash"]
    assert not (job_dir / "result.json").exists()
    assert not (job_dir / "result.json.partial").exists()
    kept = journal(job_dir)
    assert len(kept) == 2
    resume_recovers(env, tmp_path, row["id"], kept)
