"""The CLI end to end on the tiny model: run, store, MLflow, crash, kill, ingest, plugins."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrate.store.store import Store

WORKLOAD = """\
name: e2e
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 1
length_policy: {mode: fixed, frames: 4}
save_audio: 1
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }


def cli(args: list[str], env: dict, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def assert_speedups_from_utterances(run: dict) -> None:
    """Each stack's stored speedups, recomputed from the run's own per-utterance records:
    the aggregate RTF ratio by hand (total time over total audio), and the paired headline
    under the run's protocol (metrics.headline) with its pair count."""
    from orchestrate.api.protocol import Protocol
    from orchestrate.api.records import UtteranceRecord
    from orchestrate.running.metrics import HEADLINE, headline

    protocol = Protocol.model_validate(run["job"]["protocol"])
    utts = [[UtteranceRecord.model_validate(u) for u in s["utterances"]] for s in run["stacks"]]

    def rtf(us: list[UtteranceRecord]) -> float:
        return sum(u.latency_s for u in us) / sum(u.audio_s for u in us)

    for s, mine in zip(run["stacks"][1:], utts[1:], strict=True):
        m = s["metrics"]
        assert m["speedup_vs_baseline"] == pytest.approx(rtf(utts[0]) / rtf(mine), rel=1e-9)
        want = headline(utts[0], mine, protocol.speed, protocol.speed_metric)
        assert m[HEADLINE] == pytest.approx(want[HEADLINE], rel=1e-9)
        assert m[f"{HEADLINE}_n"] == len(mine) == len(utts[0])


def test_run_records_in_sqlite_and_mlflow(env, tmp_path):
    out = cli(
        [
            "run",
            "--stack",
            "cpu-fast",
            "--stack",
            "codebook",
            "--workload",
            str(tmp_path / "wl.yaml"),
            "--json",
        ],
        env,
        tmp_path,
    )
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED"
    names = [s["name"] for s in run["stacks"]]
    assert names == ["stock", "cpu-fast", "codebook"]
    _stock, fast, approx = run["stacks"]
    assert_speedups_from_utterances(run)
    assert fast["metrics"]["utterances"] == 2 and fast["metrics"]["valid_recordings"] == 2
    assert fast["exact"] and fast["fidelity"]["within_tolerance"]
    assert fast["metrics"]["median_ttfa_s"] > 0  # one-frame synthesis, timed per prompt
    assert all(u["time_to_first_audio_s"] > 0 for u in fast["utterances"])
    assert not approx["exact"] and not approx["fidelity"]["within_tolerance"]
    assert fast["applied"] == ["static_kv_cache@1", "packed_projections@1", "audio_head@1"]

    # read both stores back independently of the CLI
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        again = store.get_run(run["id"])
    assert again["stacks"][1]["metrics"] == fast["metrics"]
    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    parent = client.get_run(run["mlflow_run_id"])
    assert parent.data.tags["run_id"] == run["id"]
    assert parent.data.tags["family"] == "rumik"
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    by_name = {c.info.run_name: c for c in children}
    assert "cpu-fast" in by_name
    assert by_name["cpu-fast"].data.metrics["speedup_vs_baseline"] == pytest.approx(
        fast["metrics"]["speedup_vs_baseline"]
    )

    # the identical experiment is not re-run without --force
    out2 = cli(
        [
            "run",
            "--stack",
            "cpu-fast",
            "--stack",
            "codebook",
            "--workload",
            str(tmp_path / "wl.yaml"),
            "--json",
            "--no-mlflow",
        ],
        env,
        tmp_path,
    )
    if run["noisy"]:  # a noisy result is never served back as a clean one: measured again
        assert json.loads(out2.stdout)["id"] != run["id"]
    else:
        assert json.loads(out2.stdout) == {"run_id": run["id"], "reused": True}

    shown = cli(["show", run["id"][:8]], env, tmp_path).stdout
    assert "cpu-fast" in shown and "baseline" in shown


def test_bad_input_is_refused_before_anything_runs(env, tmp_path):
    bad = cli(
        ["run", "--stack", "nope", "--workload", str(tmp_path / "wl.yaml")],
        env,
        tmp_path,
        check=False,
    )
    assert bad.returncode == 2 and "unknown stack 'nope'" in bad.stderr
    (tmp_path / "clash.yaml").write_text(
        "name: clash\ntechniques: [{name: audio_head}, {name: codebook_head}]\n"
    )
    bad = cli(["run", "--stack", str(tmp_path / "clash.yaml")], env, tmp_path, check=False)
    assert bad.returncode == 2 and "both fill the 'head' slot" in bad.stderr
    if not __import__("torch").cuda.is_available():  # with a GPU it is no bad input
        bad = cli(["run", "--stack", "cpu-fast", "--device", "cuda"], env, tmp_path, check=False)
        assert bad.returncode == 2 and "CUDA" in bad.stderr, bad.stdout + bad.stderr
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        assert store.list_runs() == []  # nothing half-written


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _start_slow_run(env: dict, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`orchestrate run` on a long workload; returns it and its worker's pid once started."""
    slow = WORKLOAD.replace("frames: 4", "frames: 400").replace("warmups: 1", "warmups: 50")
    (tmp_path / "slow.yaml").write_text(slow)
    args = ["run", "--stack", "cpu-fast", "--workload", str(tmp_path / "slow.yaml"), "--no-mlflow"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:  # until the worker has said something (it is working)
        events = list((tmp_path / "runs").glob("*/events.jsonl"))
        if events and events[0].read_text().strip() and (kids := _children(proc.pid)):
            return proc, kids[0]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("worker never reported progress")


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc to find the worker")
def test_worker_killed_marks_run_failed(env, tmp_path):
    proc, worker = _start_slow_run(env, tmp_path)
    os.kill(worker, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "SIGKILL" in stderr
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        (row,) = store.list_runs()
        assert row["status"] == "FAILED" and "SIGKILL" in row["error"]
        assert store.get_run(row["id"])["stacks"] == []  # no partial rows
        assert any(f["run_id"] == row["id"] for f in store.list_failures())
    # what the worker said before it died is kept beside the job
    (events,) = (tmp_path / "runs").glob("*/events.jsonl")
    said = [json.loads(line)["event"] for line in events.read_text().splitlines()]
    assert "status" in said


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc")
def test_orchestrator_terminated_marks_run_interrupted(env, tmp_path):
    proc, _ = _start_slow_run(env, tmp_path)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        (row,) = store.list_runs()
        assert row["status"] == "INTERRUPTED"


def test_worker_result_ingested(env, tmp_path):
    """The offline-GPU-host path: plan here, `orchestrate worker` there, `ingest` here."""
    from orchestrate.api.config import load_model_spec, load_stack, load_workload
    from orchestrate.api.protocol import load_protocol
    from orchestrate.running.plan import plan_job

    job = plan_job(
        load_model_spec("tiny"),
        load_workload(str(tmp_path / "wl.yaml")),
        [load_stack("stock"), load_stack("static-cache")],
        load_protocol(),
        tmp_path / "host",
    )
    job.write(tmp_path / "job.json")
    cli(
        ["worker", str(tmp_path / "job.json"), "--out", str(tmp_path / "result.json")],
        env,
        tmp_path,
    )
    out = cli(["ingest", str(tmp_path / "result.json"), "--json"], env, tmp_path)
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["job_id"] == job.job_id
    assert_speedups_from_utterances(run)
    again = cli(["ingest", str(tmp_path / "result.json")], env, tmp_path, check=False)
    assert again.returncode == 2 and "already" in again.stderr
    (tmp_path / "junk.json").write_text('{"status": "finished"}')
    junk = cli(["ingest", str(tmp_path / "junk.json")], env, tmp_path, check=False)
    assert junk.returncode == 2 and "not a valid result record" in junk.stderr


PLUGIN = '''
"""A third-party technique: stock's sampler, with the -inf mask built once, not per step."""
import torch
from orchestrate.families.rumik.engine import stock_sampler
from orchestrate.api.technique import Technique


class CachedMaskSampler(Technique):
    name = "cached_mask_sampler"
    family = "rumik"
    exact = True
    slots = ("sampler",)
    summary = "third-party test plugin"

    def apply(self, engine):
        cache = {}

        def sampler(head, *, allow_end, force_end, sampling, generator):
            key = (head.logits.shape[-1], allow_end, force_end)
            if key not in cache:
                mask = torch.full_like(head.logits, float("-inf"))
                if force_end:
                    mask[:, head.end_column] = 0.0
                else:
                    mask[:, head.unit_columns] = 0.0
                    if allow_end:
                        mask[:, head.end_column] = 0.0
                cache[key] = mask
            scores = (head.logits + cache[key]) / sampling.temperature
            vals, idx = torch.topk(scores, min(sampling.top_k, scores.shape[-1]), dim=-1)
            pick = torch.multinomial(torch.softmax(vals, -1), 1, generator=generator)
            col = idx.gather(-1, pick)
            return col if head.column_ids is None else head.column_ids[col]

        engine.sampler = sampler
'''


@pytest.mark.slow
def test_third_party_plugin_installed_with_pip(env, tmp_path):
    pkg = tmp_path / "plugin"
    (pkg / "cached_mask_plugin").mkdir(parents=True)
    (pkg / "cached_mask_plugin" / "__init__.py").write_text(PLUGIN)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent("""\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "cached-mask-plugin"
        version = "0.1"
        [project.entry-points."orchestrate.techniques"]
        cached_mask_sampler = "cached_mask_plugin:CachedMaskSampler"
        """)
    )
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-build-isolation", str(pkg)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    try:
        listed = json.loads(cli(["techniques", "--json"], env, tmp_path).stdout)
        row = next(r for r in listed if r["name"] == "cached_mask_sampler")
        assert row["module"] == "cached_mask_plugin" and row["slots"] == ["sampler"]
        (tmp_path / "p.yaml").write_text(
            "name: plugged\ntechniques: [{name: audio_head}, {name: cached_mask_sampler}]\n"
        )
        run = json.loads(
            cli(
                [
                    "run",
                    "--stack",
                    str(tmp_path / "p.yaml"),
                    "--workload",
                    str(tmp_path / "wl.yaml"),
                    "--json",
                    "--no-mlflow",
                ],
                env,
                tmp_path,
            ).stdout
        )
        plugged = run["stacks"][1]
        assert plugged["status"] == "ok" and "cached_mask_sampler@1" in plugged["applied"]
        assert plugged["fidelity"]["within_tolerance"]
    finally:
        subprocess.run(
            [*pip, "uninstall", "-y", "cached-mask-plugin"],
            check=True,
            capture_output=True,
            timeout=300,
        )


def test_gpu_members_skipped_on_cpu_and_refused_with_strict(env, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA: nothing would be skipped")
    out = cli(
        [
            "run",
            "--stack",
            "exp74",
            "--workload",
            str(tmp_path / "wl.yaml"),
            "--json",
            "--no-mlflow",
            "--fidelity-steps",
            "0",
        ],
        env,
        tmp_path,
    )
    run = json.loads(out.stdout)
    assert run["status"] == "PARTIAL"
    exp74 = run["stacks"][1]
    assert exp74["status"] == "partial"
    assert exp74["applied"] == ["static_kv_cache@1", "codebook_head@1"]
    assert set(exp74["skipped"]) == {
        "int8_projections",
        "decode_attention",
        "device_sampler",
        "graph_loop",
    }
    assert "CUDA" in exp74["skipped"]["int8_projections"]
    assert "CUDA" in exp74["skipped"]["graph_loop"]
    strict = cli(
        [
            "run",
            "--stack",
            "exp74",
            "--workload",
            str(tmp_path / "wl.yaml"),
            "--strict",
            "--no-mlflow",
        ],
        env,
        tmp_path,
        check=False,
    )
    assert strict.returncode == 2
    assert "'int8_projections' cannot run here: needs a CUDA device" in strict.stderr
