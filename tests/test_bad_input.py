"""Bad input and faults through the CLI: exit code, one line on stderr, the specific text.

Most cases fail before any worker starts (a few seconds each); the two that run a worker use
a 4-frame workload with fidelity off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import run_cli as cli

from orchestrate.api.config import ModelSpec, Prompt, StackSpec, Workload
from orchestrate.api.records import JobSpec
from orchestrate.store.store import Store

WORKLOAD = """\
name: bad-input
prompts:
  - {id: a, text: "A short first sentence."}
seeds: [42]
warmups: 0
length_policy: {mode: fixed, frames: 4}
save_audio: 0
"""
TRACEBACK = """worker exited with status 1; last output:
Traceback (most recent call last):
  File "worker.py", line 1, in <module>
    boom()
RuntimeError: the decoder fell over

"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }


def refused(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Run a command that must fail with exit 2 and one stderr line; return that line."""
    proc = cli(args, env, cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "http" not in lines[0] and "pydantic" not in lines[0]
    return lines[0]


# ------------------------------------------------------------- refused before any worker


def test_stack_shadowing_the_baseline_is_refused(env, tmp_path):
    (tmp_path / "stock.yaml").write_text("name: stock\ntechniques: [{name: audio_head}]\n")
    line = refused(["run", "--stack", str(tmp_path / "stock.yaml")], env, tmp_path)
    assert "has the baseline's name but other techniques" in line
    assert str(tmp_path / "stock.yaml") in line and "experiments/stock.yaml" in line


def test_blank_prompt_is_refused_with_its_id(env, tmp_path):
    (tmp_path / "blank.yaml").write_text(
        WORKLOAD.replace(
            '  - {id: a, text: "A short first sentence."}', '  - {id: quiet, text: "  \\t "}'
        )
    )
    line = refused(["run", "--stack", "cpu-fast", "--workload", "blank.yaml"], env, tmp_path)
    assert "prompt 'quiet' has no text" in line


def test_option_errors_are_one_line_in_the_clis_words(env, tmp_path):
    args = ["run", "--stack", "cpu-fast", "--workload", "wl.yaml"]
    line = refused([*args, "--fidelity-steps", "-5"], env, tmp_path)
    assert line == "error: --fidelity-steps must be >= 0, got -5"
    line = refused([*args, "--dtype", "int4"], env, tmp_path)
    assert "--dtype must be one of float32, bfloat16, float16, got 'int4'" in line
    assert refused(["runs", "--limit", "0"], env, tmp_path) == "error: --limit must be >= 1, got 0"


@pytest.mark.parametrize(
    "option, path",
    [
        ("--stack", "/missing/stack.yaml"),
        ("--stack", "missing.yaml"),
        ("--workload", "/missing/wl.yaml"),
        ("--model", "/missing/weights"),
    ],
)
def test_missing_path_says_no_such_file(env, tmp_path, option, path):
    args = ["run", "--stack", "cpu-fast", "--workload", "wl.yaml", option, path]
    if option == "--stack":
        args = ["run", "--stack", path, "--workload", "wl.yaml"]
    assert refused(args, env, tmp_path) == f"error: no such file: {path}"


def test_bad_job_file_for_the_worker_is_one_line(env, tmp_path):
    assert refused(["worker", "missing.json"], env, tmp_path) == "error: no such file: missing.json"
    (tmp_path / "job.json").write_text('{"model": {}}')
    line = refused(["worker", "job.json"], env, tmp_path)
    assert line.startswith("error: job.json: not a valid job: workload: Field required")


# --------------------------------------------------------------- failed and interrupted runs


def _seed_failed_runs(url: str) -> dict[str, str]:
    """A FAILED run with a worker traceback and an INTERRUPTED one, straight in the store."""
    job = JobSpec(
        model=ModelSpec(),
        workload=Workload(name="w", prompts=[Prompt(id="a", text="Hi.")]),
        stacks=[StackSpec(name="stock")],
        output_dir="out",
    )
    with Store(url) as store:
        failed = store.begin_run(job, "failed-identity")
        store.fail_run(failed, "FAILED", TRACEBACK)
        again = job.model_copy(update={"job_id": "interrupted1"})
        interrupted = store.begin_run(again, "interrupted-identity")
        store.fail_run(interrupted, "INTERRUPTED", "orchestrator received SIGTERM")
    return {"failed": failed, "interrupted": interrupted}


def test_show_and_runs_say_why_a_run_failed(env, tmp_path):
    ids = _seed_failed_runs(env["ORCHESTRATE_DB_URL"])
    shown = cli(["show", ids["failed"][:12]], env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "FAILED" in lines[0]
    assert lines[1] == "error: RuntimeError: the decoder fell over"  # the traceback's last line
    shown = cli(["show", ids["interrupted"][:12]], env, tmp_path).stdout.splitlines()
    assert shown[1] == "error: orchestrator received SIGTERM"
    listed = cli(["runs"], env, tmp_path).stdout
    assert "RuntimeError: the decoder fell over" in listed and "Traceback" not in listed
    assert "()" not in listed


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to find the worker")
def test_ctrl_c_names_the_interrupt(env, tmp_path):
    slow = WORKLOAD.replace("frames: 4", "frames: 400").replace("warmups: 0", "warmups: 50")
    (tmp_path / "slow.yaml").write_text(slow)
    args = ["run", "--stack", "cpu-fast", "--workload", "slow.yaml", "--no-mlflow"]
    # Ctrl-C as at a terminal: a process started in the background (nohup, `cmd &` in a
    # script) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.time() + 180
        while not list((tmp_path / "runs").glob("*/events.jsonl")) and time.time() < deadline:
            time.sleep(0.2)  # the worker has started: the run row exists
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a run that ignored Ctrl-C must not decode on after the test
    assert proc.returncode == 130
    last = stderr.strip().splitlines()[-1]
    assert last == "error: interrupted (Ctrl-C); the run is marked INTERRUPTED"


# ------------------------------------------------------------------------- a partial run


def test_partial_run_says_what_it_skipped_and_why(env, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: nothing would be skipped")
    # A --stack identical to the baseline is just the baseline: no error, measured once.
    (tmp_path / "stock.yaml").write_text("name: stock\ndescription: mine\ntechniques: []\n")
    args = ["run", "--stack", "stock.yaml", "--stack", "exp74", "--workload", "wl.yaml"]
    proc = cli([*args, "--fidelity-steps", "0", "--no-mlflow"], env, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.lstrip("│ ").startswith("stock ")]
    assert len(rows) == 1
    (skipped,) = [line for line in proc.stdout.splitlines() if line.startswith("exp74: skipped")]
    assert "int8_projections" in skipped and "graph_loop" in skipped
    assert skipped.endswith("(needs a CUDA device (running on the CPU))")


# ------------------------------------------------------------------ the lines themselves


def test_error_line_keeps_what_matters():
    from orchestrate.reports.tables import error_line

    assert error_line(TRACEBACK) == "RuntimeError: the decoder fell over"
    killed = "worker killed by SIGKILL (out of memory?); last output:\nloading model\nstep 3"
    assert error_line(killed) == "worker killed by SIGKILL (out of memory?): step 3"
    assert error_line("worker exited with status 1") == "worker exited with status 1"
    assert error_line(None) == error_line("") == ""
    assert error_line("x" * 100, width=10) == "x" * 9 + "…"


def test_skipped_lines_group_techniques_by_reason():
    from orchestrate.reports.tables import skipped_lines

    stacks = [
        {"name": "stock", "skipped": {}},
        {
            "name": "cpu-fast",
            "skipped": {"a": "needs CUDA", "b": "needs triton", "c": "needs CUDA"},
        },
    ]
    assert skipped_lines(stacks) == ["cpu-fast: skipped a, c (needs CUDA); b (needs triton)"]
