"""Bad storage input and faults: one clear line, exit 2, nothing lost, nothing overwritten.

Every storage case goes through the CLI in a subprocess (what a user sees); the runner's
ordering (database before MLflow) and the worker-error line are also checked in-process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from factories import MakeResult
from factories import run_cli as cli

from orchestrate.running import runner
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
FAST = ["--stack", "cpu-fast", "--fidelity-steps", "0"]  # the tiny model; about 30 s a run


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }


def one_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    """The command failed with exit 2 and exactly one non-blank stderr line, containing
    every `expected` fragment."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(lines) == 1, proc.stderr
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------ database

FIX = "pass --db or set ORCHESTRATE_DB_URL"
CORRUPTED = "is not a SQLite database (corrupted or not ours): restore it from a backup"


def _random_file(tmp: Path) -> Path:
    path = tmp / "random.db"
    path.write_bytes(os.urandom(8192))
    return path


def _truncated_file(tmp: Path) -> Path:
    path = tmp / "truncated.db"
    Store(f"sqlite:///{path}").close()  # a real, migrated database (WAL folded back in)
    assert not path.with_name("truncated.db-wal").exists()
    with path.open("r+b") as f:
        f.truncate(8192)
    return path


@pytest.mark.parametrize(
    ("make_url", "expected"),
    [
        (
            lambda t: f"sqlite:///{t / 'missing' / 'o.db'}",
            ["cannot open database sqlite:///", "/missing does not exist", FIX],
        ),
        (
            lambda t: "sqlite:////proc/orchestrate-test.db",
            ["cannot create database sqlite:////proc/", "folder /proc is not writable", FIX],
        ),
        (lambda t: "sqlite:////proc", ["database sqlite:////proc is a directory", FIX]),
        (lambda t: f"sqlite:///{t}", ["is a directory, not a database file", FIX]),
        (
            lambda t: str(t / "o.db"),
            ["is not a URL (for a SQLite file write sqlite:////", FIX],
        ),
        (lambda t: "nosuchdialect://h/x", ["unknown database kind 'nosuchdialect'", FIX]),
    ],
    ids=["missing-folder", "proc", "proc-itself", "directory", "not-a-url", "unknown-dialect"],
)
def test_unusable_database_is_one_line(
    env: dict[str, str], tmp_path: Path, make_url: Any, expected: list[str]
) -> None:
    one_error(cli(["runs", "--db", make_url(tmp_path)], env, tmp_path), *expected)


@pytest.mark.skipif(
    importlib.util.find_spec("psycopg") is not None, reason="psycopg is installed here"
)
def test_postgres_without_driver_names_the_package(env: dict[str, str], tmp_path: Path) -> None:
    url = "postgresql://me:secret@db.example/orchestrate"
    line = one_error(
        cli(["runs", "--db", url], env, tmp_path),
        "needs the driver package psycopg[binary] (module psycopg)",
        "pip install 'psycopg[binary]'",
    )
    assert "secret" not in line  # passwords never reach a terminal or a CI log


@pytest.mark.parametrize("make", [_random_file, _truncated_file], ids=["random", "truncated"])
def test_corrupted_database_is_named_and_never_written(
    env: dict[str, str], tmp_path: Path, make: Any
) -> None:
    path = make(tmp_path)
    before = path.read_bytes()
    one_error(cli(["runs", "--db", f"sqlite:///{path}"], env, tmp_path), CORRUPTED)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.glob(f"{path.name}*")) == [path.name]  # no -wal


def test_run_checks_the_database_before_a_worker(env: dict[str, str], tmp_path: Path) -> None:
    path = _random_file(tmp_path)
    before = path.read_bytes()
    args = ["run", *FAST, "--workload", str(tmp_path / "wl.yaml"), "--db", f"sqlite:///{path}"]
    one_error(cli(args, env, tmp_path), CORRUPTED)
    assert path.read_bytes() == before and not (tmp_path / "runs").exists()


@pytest.fixture
def immutable_db(tmp_path: Path) -> Any:
    """A real database made immutable (chattr +i stops root too, unlike chmod)."""
    path = tmp_path / "frozen.db"
    Store(f"sqlite:///{path}").close()
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    yield path
    subprocess.run(["chattr", "-i", str(path)], check=True)


def test_read_only_database_is_one_line(
    env: dict[str, str], tmp_path: Path, immutable_db: Path
) -> None:
    before = immutable_db.read_bytes()
    one_error(
        cli(["runs", "--db", f"sqlite:///{immutable_db}"], env, tmp_path),
        "frozen.db is read-only",
        "make it writable or pass --db with a writable copy",
    )
    assert immutable_db.read_bytes() == before


# ----------------------------------------------------------------- runs folder, MLflow


@pytest.mark.parametrize(
    ("runs_dir", "expected"),
    [
        (lambda t: "/proc/orchestrate-runs", "runs folder /proc/orchestrate-runs is not writable"),
        (lambda t: str(t / "afile" / "runs"), "afile is a file, not a folder"),
    ],
    ids=["proc", "under-a-file"],
)
def test_unwritable_runs_dir_is_one_line_before_anything_starts(
    env: dict[str, str], tmp_path: Path, runs_dir: Any, expected: str
) -> None:
    (tmp_path / "afile").write_text("")
    args = ["run", *FAST, "--workload", str(tmp_path / "wl.yaml"), "--runs-dir", runs_dir(tmp_path)]
    one_error(cli(args, env, tmp_path), expected, "pass --runs-dir with a writable folder")
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        assert store.list_runs() == []


def test_unusable_mlflow_store_is_one_line_before_anything_starts(
    env: dict[str, str], tmp_path: Path
) -> None:
    bad = {**env, "MLFLOW_TRACKING_URI": "sqlite:////proc/orchestrate-mlflow.db"}
    one_error(
        cli(["run", *FAST, "--workload", str(tmp_path / "wl.yaml")], bad, tmp_path),
        "cannot create MLflow store sqlite:////proc/orchestrate-mlflow.db",
        "set MLFLOW_TRACKING_URI or pass --no-mlflow",
    )
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        assert store.list_runs() == []


def _mlflow_parent(uri: str, mlflow_run_id: str) -> Any:
    import mlflow

    return mlflow.MlflowClient(uri).get_run(mlflow_run_id)


def test_mlflow_failing_after_the_measurement_keeps_the_run(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The MLflow store opens (the check passes) but its artifact folder is a file: the run
    stays FINISHED, the warning names sync-mlflow, and sync-mlflow logs it later."""
    (tmp_path / "mlruns").write_text("")  # where MLflow puts this cwd's artifacts
    out = cli(["run", *FAST, "--workload", str(tmp_path / "wl.yaml"), "--json"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["mlflow_run_id"] is None
    warning = "warning: MLflow logging failed (NotADirectoryError: "
    assert warning in out.stderr and f"orchestrate sync-mlflow {run['id']}" in out.stderr
    assert "Traceback" not in out.stderr

    (tmp_path / "mlruns").unlink()
    good = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'good' / 'mlflow.db'}"}
    synced = cli(["sync-mlflow"], good, tmp_path)
    assert synced.returncode == 0 and f"run {run['id']}: logged" in synced.stdout, synced.stderr
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        stored = store.get_run(run["id"], utterances=False)
    assert stored["status"] == "FINISHED" and stored["mlflow_run_id"]
    assert all(s["mlflow_run_id"] for s in stored["stacks"])
    parent = _mlflow_parent(good["MLFLOW_TRACKING_URI"], stored["mlflow_run_id"])
    assert parent.data.tags["run_id"] == run["id"]
    again = cli(["sync-mlflow"], good, tmp_path)
    assert "nothing to log" in again.stdout


def test_ingest_with_mlflow_down_records_and_says_how_to_sync(
    env: dict[str, str], tmp_path: Path, make_result_record: MakeResult
) -> None:
    result = make_result_record(audio_dir=tmp_path / "job")
    result.write(tmp_path / "job" / "result.json")
    down = {**env, "MLFLOW_TRACKING_URI": "sqlite:////proc/orchestrate-mlflow.db"}
    out = cli(["ingest", str(tmp_path / "job" / "result.json"), "--json"], down, tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["mlflow_run_id"] is None
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"orchestrate sync-mlflow {run['id']}" in warnings[0]

    one_error(cli(["sync-mlflow"], down, tmp_path), "cannot create MLflow store")
    synced = cli(["sync-mlflow", run["id"][:8]], env, tmp_path)
    assert synced.returncode == 0, synced.stderr
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        parent_id = store.get_run(run["id"], utterances=False)["mlflow_run_id"]
    parent = _mlflow_parent(env["MLFLOW_TRACKING_URI"], parent_id)
    assert parent.data.tags["run_id"] == run["id"] and parent.info.status == "FINISHED"


@pytest.mark.slow
def test_concurrent_runs_share_a_fresh_mlflow_store(env: dict[str, str], tmp_path: Path) -> None:
    """Four runs started at once against a store none has created: all FINISHED, all
    logged (no `_alembic_tmp_experiments already exists`, no database-locked failures)."""
    fresh = {**env, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"}
    args = ["run", *FAST, "--workload", str(tmp_path / "wl.yaml"), "--force", "--json"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestrate.cli", *args],
            env=fresh,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert "warning:" not in stderr, stderr
    runs = [json.loads(stdout) for stdout, _ in outputs]
    assert all(r["status"] == "FINISHED" and r["mlflow_run_id"] for r in runs)
    assert len({r["mlflow_run_id"] for r in runs}) == 4
    for r in runs:
        parent = _mlflow_parent(fresh["MLFLOW_TRACKING_URI"], r["mlflow_run_id"])
        assert parent.data.tags["run_id"] == r["id"]


# ------------------------------------------------------------------ runner, in-process


def test_database_is_written_before_mlflow_and_mlflow_failure_is_a_warning(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_result_record: MakeResult,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from orchestrate.store import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(tracking, "RETRY_PAUSE_S", 0.0)
    store = Store(f"sqlite:///{tmp_path / 'runs.db'}")
    job = make_result_record().job

    def fake_worker(job_path: Path, result_path: Path, log_path: Path, on_event: Any) -> int:
        make_result_record(job_id=job.job_id).write(result_path)
        return 0

    seen: list[str] = []

    def broken_log_run(result: Any, run_id: str, *args: Any) -> str:
        seen.append(store.get_run(run_id, utterances=False)["status"])
        raise RuntimeError("tracking server said no\nand a second line")

    monkeypatch.setattr(runner, "spawn_worker", fake_worker)
    monkeypatch.setattr(tracking, "log_run", broken_log_run)
    outcome = runner.execute(job, store, tmp_path / "runs")
    assert seen == ["FINISHED"] * tracking.ATTEMPTS  # recorded before MLflow was tried
    assert outcome.status == "finished" and outcome.mlflow_run_id is None
    run = store.get_run(outcome.run_id, utterances=False)
    assert run["status"] == "FINISHED" and run["mlflow_run_id"] is None
    expected = (
        f"MLflow logging failed (RuntimeError: tracking server said no); run {outcome.run_id} "
        f"is recorded in the database; log it later with: orchestrate sync-mlflow "
        f"{outcome.run_id}"
    )
    assert outcome.mlflow_warning == expected
    err = capsys.readouterr().err  # MLflow's own INFO lines may come first
    assert [line for line in err.splitlines() if "warning" in line] == [f"warning: {expected}"]
    store.close()


TRACEBACK_THEN_WARNING = """\
/venv/lib/python3.11/site-packages/transformers/utils/generic.py:441: FutureWarning: deprecated
  _torch_pytree._register_pytree_node(
Traceback (most recent call last):
  File "/work/main/orchestrator/running/worker.py", line 289, in <module>
    sys.exit(main())
             ^^^^^^
  File "/work/main/families/rumik/model.py", line 153, in _resolve_folder
    raise ValueError(
ValueError: weights folder /x has no config.json
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: leaked semaphore
  warnings.warn('resource_tracker: There appear to be %d '
"""


def test_describe_exit_reports_the_exception_not_a_warning(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text(TRACEBACK_THEN_WARNING)
    assert runner.describe_exit(1, log) == (
        f"worker exited with status 1: ValueError: weights folder /x has no config.json "
        f"(worker log: {log})"
    )
    chained = TRACEBACK_THEN_WARNING + (
        "\nDuring handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "orchestrate.families.rumik.model.WeightsError: no weights at /y\n"
    )
    log.write_text(chained)
    assert "WeightsError: no weights at /y (worker log:" in runner.describe_exit(1, log)
    log.write_text("loading\nmodel.py:3: UserWarning: slow path\n  warnings.warn(x)\n")
    where = f"worker log: {log}"
    assert runner.describe_exit(1, log) == f"worker exited with status 1: loading ({where})"
    (tmp_path / "events.jsonl").write_text('{"event": "error", "message": "OOM: out of memory"}\n')
    assert runner.describe_exit(-9, log) == (
        f"worker killed by SIGKILL (out of memory?): OOM: out of memory (worker log: {log})"
    )
