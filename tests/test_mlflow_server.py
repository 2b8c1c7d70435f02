"""One MLflow tracking server for a team (issue 32): `mlflow server` on PostgreSQL with an
artifacts folder, and orchestrate logging a real tiny CPU run to it over HTTP
(MLFLOW_TRACKING_URI=http://...), read back through MlflowClient. A server that does not
answer is one line (exit 2), before anything is measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pg_server import PgServer, free_port

WORKLOAD = """\
name: team
prompts:
  - {id: a, text: "A short sentence."}
seeds: [42]
warmups: 0
length_policy: {mode: fixed, frames: 4}
save_audio: 1
"""


@contextmanager
def mlflow_server(server: PgServer, tmp_path: Path) -> Iterator[tuple[str, str, Path, Any]]:
    """`mlflow server` started on a free port of 127.0.0.1, its runs in a new PostgreSQL
    database and its artifacts in a folder: yields (its URI, that database, the folder, a
    function waiting until it answers); killed on leaving (its data is thrown away)."""
    backend = server.create_database()
    artifacts, port = tmp_path / "mlartifacts", free_port()
    uri, log = f"http://127.0.0.1:{port}", tmp_path / "mlflow-server.log"
    command = [
        str(Path(sys.executable).with_name("mlflow")), "server",
        "--backend-store-uri", server.url(backend),
        "--artifacts-destination", str(artifacts),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    # MLflow's job runner (huey workers for its GenAI jobs) logs nothing orchestrate needs;
    # off, the server is 2 processes instead of 10 and starts in about 60% of the time.
    env = os.environ | {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:  # its own session: killing it kills its workers too
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield uri, backend, artifacts, lambda: _wait_until_up(uri, proc, log)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_until_up(uri: str, server: subprocess.Popen, log: Path, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited {server.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"mlflow server not up after {limit_s:.0f} s: {log.read_text()[-2000:]}")


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_run_logs_to_the_teams_mlflow_server(pg_server: PgServer, tmp_path: Path) -> None:
    """A tiny CPU run, its database and MLflow's both on the PostgreSQL server: the run, its
    metrics and its artifacts (result.json, a WAV) are on the MLflow server, the files in
    its artifacts folder. While the server starts, a command pointed at a port nothing
    answers on is one line naming the URI (exit 2)."""
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    env = os.environ | {
        "ORCHESTRATE_DB_URL": pg_server.url(pg_server.create_database()),
        "ORCHESTRATE_CODE_SHA": "7" * 40,
    }
    with mlflow_server(pg_server, tmp_path) as (uri, backend, artifacts, wait_until_up):
        nobody = f"http://127.0.0.1:{free_port()}"
        silent = _cli(["sync-mlflow"], env | {"MLFLOW_TRACKING_URI": nobody}, tmp_path)
        _, refused = silent.communicate(timeout=120)
        assert silent.returncode == 2
        assert refused.strip() == (
            f"error: cannot open MLflow store {nobody}: nothing listens at {nobody[7:]} "
            "(connection refused): start the server or correct the host and port; set "
            "MLFLOW_TRACKING_URI or pass --no-mlflow"
        )
        wait_until_up()
        run = _cli(["run", "--stack", "stock", "--workload", "wl.yaml", "--fidelity-steps", "0",
                    "--json"], env | {"MLFLOW_TRACKING_URI": uri}, tmp_path)  # fmt: skip
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err  # and stdout is the record alone (no "View run at")
        check_logged(uri, json.loads(out), backend, artifacts, pg_server)


def check_logged(
    uri: str, recorded: dict[str, Any], backend: str, artifacts: Path, server: PgServer
) -> None:
    """The run (`run --json`'s record) as the MLflow server holds it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(recorded["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["run_id"] == recorded["id"]
    (child,) = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    (stock,) = recorded["stacks"]
    assert child.data.metrics["rtf"] == pytest.approx(stock["metrics"]["rtf"])
    assert "result.json" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    (wav,) = client.list_artifacts(child.info.run_id, "audio")
    assert wav.path.endswith(".wav") and wav.file_size > 0
    # Stored by the server: the files in its folder, its runs in its PostgreSQL database.
    assert len(list(artifacts.rglob("result.json"))) == 1
    assert {"experiments", "runs", "metrics"} <= set(server.tables(backend))
