"""`orchestrate run --resume RUN`: a run killed half-way is continued, nothing measured is
lost or measured twice, and a resume that would mix incompatible measurements is refused
with one line (exit 2) before anything runs.

The worker is killed by its test hook (ORCHESTRATE_FAULT, read only by the worker), on the
tiny model: 2 prompts x 1 seed, 4 frames each, stock and cpu-fast interleaved.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrate.api.records import ResultRecord
from orchestrate.running.runner import ResumeRefused, plan_resume
from orchestrate.store.store import RunNotFound, Store

WORKLOAD = """\
name: resume
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 1
length_policy: {mode: fixed, frames: 4}
save_audio: 1
"""
RUN = ["run", "--stack", "cpu-fast", "--workload", "wl.yaml", "--fidelity-steps", "4"]
TRIPLES = {(s, p, 42) for s in ("stock", "cpu-fast") for p in ("a", "b")}
SHA = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    return {
        **os.environ,
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
        # Pinned: this tree's uncommitted changes (others edit it meanwhile) would otherwise
        # change the code identity between the killed run and its resume.
        "ORCHESTRATE_CODE_SHA": SHA,
        "PYTHONUNBUFFERED": "1",
    }


def cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args, "--no-mlflow"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def one_error(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert len(lines) == 1, proc.stderr
    for fragment in expected:
        assert fragment in lines[0], lines[0]
    return lines[0]


def journal(job_dir: Path) -> dict[tuple[str, str, int], dict[str, Any]]:
    """utterances.jsonl as {(stack, prompt, seed): utterance}."""
    rows = [json.loads(line) for line in (job_dir / "utterances.jsonl").read_text().splitlines()]
    return {(r["stack"], r["utterance"]["prompt_id"], r["utterance"]["seed"]): r for r in rows}


def killed_run(env: dict[str, str], tmp_path: Path, fault: str) -> tuple[str, Path]:
    """A run whose worker the hook kills: (run id, job folder)."""
    proc = cli(RUN, {**env, "ORCHESTRATE_FAULT": fault}, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "worker killed by SIGKILL" in proc.stderr and "out of memory" not in proc.stderr
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        (row,) = store.list_runs()
    assert row["status"] == "FAILED"
    (job_dir,) = (tmp_path / "runs").iterdir()
    return row["id"], job_dir


@pytest.mark.slow
def test_a_killed_run_resumes_to_one_whole_result(env: dict[str, str], tmp_path: Path) -> None:
    old_id, old_dir = killed_run(env, tmp_path, "kill_after_utterances:3")
    before = journal(old_dir)
    assert len(before) == 3

    out = cli(["run", "--resume", old_id[:8], "--json"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["resumed_from"] == old_id and run["id"] != old_id
    pairs = [
        ((s["name"], u["prompt_id"], u["seed"]), u) for s in run["stacks"] for u in s["utterances"]
    ]
    assert sorted(k for k, _ in pairs) == sorted(TRIPLES)  # every (stack, prompt, seed) once
    utts = dict(pairs)
    resumed = {k for k, u in utts.items() if u["resumed"]}
    assert resumed == set(before)  # the first 3, carried over with their measurements
    for key in resumed:
        assert utts[key]["latency_s"] == before[key]["utterance"]["latency_s"]
        assert utts[key]["round"] == before[key]["utterance"]["round"]
    # each utterance names the worker that timed it: pairs form only within one
    assert {utts[k]["timed_by"] for k in resumed} == {old_dir.name}
    assert {u["timed_by"] for k, u in utts.items() if k not in resumed} == {run["job_id"]}
    workers = {p: {utts[(s, p, 42)]["timed_by"] for s in ("stock", "cpu-fast")} for p in "ab"}
    split = [p for p, timed_by in workers.items() if len(timed_by) == 2]  # a round cut in two
    fast = next(s for s in run["stacks"] if s["name"] == "cpu-fast")
    assert fast["metrics"]["speedup_paired_n"] == 2 - len(split)
    assert all(s["metrics"]["utterances"] == 2 for s in run["stacks"])

    # the new job folder is whole: result (marked), journal of all four, every WAV it names
    new_dir = tmp_path / "runs" / run["job_id"]
    result = ResultRecord.read(new_dir / "result.json")
    assert result.job.resumed_from == old_id
    assert {(r.stack.name, u.prompt_id, u.seed) for r in result.results for u in r.utterances
            if u.resumed} == resumed  # fmt: skip
    assert set(journal(new_dir)) == TRIPLES
    for u in utts.values():
        assert u["audio_path"] is None or (new_dir / u["audio_path"]).is_file()

    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        old = store.get_run(old_id)
        assert store.get_result(run["id"]).job.resumed_from == old_id
    assert old["status"] == "FAILED" and old["stacks"] == []  # kept as it was
    assert old["error"].startswith("worker killed by SIGKILL")
    assert old["resumed_by"] == [run["id"]]  # the pointer to its continuation

    one_error(
        cli(["run", "--resume", run["id"][:8]], env, tmp_path),
        f"cannot resume run {run['id'][:12]}: it is FINISHED",
    )
    one_error(
        cli(["run", "--resume", old_id[:8]], env, tmp_path),
        f"cannot resume run {old_id[:12]}: it was resumed already as run {run['id'][:12]}",
    )


@pytest.mark.slow
def test_a_resume_on_a_faster_host_is_marked_noisy(env: dict[str, str], tmp_path: Path) -> None:
    """Each utterance keeps the single-thread speed of the host that timed it; a resume on a
    host 1000x as fast as the killed run's (its journal edited to say so) finishes, and the run
    says its figures mix hosts instead of quoting them as one host's. (A 10x edit failed on a
    contended CI host, whose resumed loop ran 2.5x slower than the killed run's: 4.0x spread.)"""
    old_id, old_dir = killed_run(env, tmp_path, "kill_after_utterances:2")
    path = old_dir / "utterances.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["utterance"]["host_loop_ms"] > 0 for r in rows)  # recorded by the worker
    for r in rows:
        r["utterance"]["host_loop_ms"] *= 1000  # far past this machine's own jitter and load
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    out = cli(["run", "--resume", old_id[:8], "--json"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED"
    spreads = {s["name"]: s["metrics"].get("host_loop_spread") for s in run["stacks"]}
    mixed = [name for name, spread in spreads.items() if spread and spread > 50]
    assert mixed, spreads  # the stacks with carried utterances: both hosts' speeds
    assert any("timed on hosts whose single-thread loop differs" in n for n in run["noisy"])


def _edit_job(path: Path, **changes: Any) -> None:
    job = json.loads(path.read_text())
    path.write_text(json.dumps({**job, **changes}))


def test_resume_is_refused_when_it_would_mix_measurements(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, job_dir = killed_run(env, tmp_path, "kill_at:build")  # fast: nothing measured
    rid = run_id[:12]
    resume = ["run", "--resume", run_id[:8]]
    one_error(cli([*resume, "--stack", "cpu-fast"], env, tmp_path), "drop --stack")
    # this tree is at another commit than the one the run measured
    other = {**env, "ORCHESTRATE_CODE_SHA": "0" * 40}
    one_error(
        cli(resume, other, tmp_path),
        f"cannot resume run {rid}: it was measured with code SHA {SHA} and this tree has "
        f"{'0' * 40}; resuming would mix measurements of different code",
    )
    # the stored job names another commit
    job_file = job_dir / "job.json"
    original = job_file.read_text()
    _edit_job(job_file, code_sha="1" * 40)
    one_error(cli(resume, env, tmp_path), f"code SHA {'1' * 40} and this tree has {SHA}")
    job_file.write_text(original)

    # the other refusals in-process (each CLI call costs seconds of imports): the same
    # ResumeRefused line the CLI prints
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", SHA)
    store = Store(env["ORCHESTRATE_DB_URL"])

    def refused(*expected: str) -> None:
        with pytest.raises(ResumeRefused) as caught:
            plan_resume(store, run_id)
        assert all(e in str(caught.value) for e in expected), caught.value
        assert "\n" not in str(caught.value)

    with pytest.raises(RunNotFound, match="no run with id 'ffffffff'"):
        plan_resume(store, "ffffffff")
    # the database's copy of the job names another commit
    db = sqlite3.connect(tmp_path / "runs.db")
    (stored,) = db.execute("SELECT job_json FROM runs").fetchone()
    with db:
        db.execute("UPDATE runs SET job_json = ?", (stored.replace(SHA, "2" * 40),))
    refused(f"code SHA {'2' * 40} and this tree has {SHA}")
    with db:
        db.execute("UPDATE runs SET job_json = ?", (stored,))
    db.close()
    # a technique's source changed since
    job = json.loads(original)
    job["technique_code"]["audio_head"]["source"] = "0123456789abcdef"
    job_file.write_text(json.dumps(job))
    refused("technique audio_head was version 1 with source hash 0123456789abcdef",
            "resuming would mix measurements of different code")  # fmt: skip
    job_file.write_text(original)
    # an utterance it kept was timed on another device
    line = {"stack": "stock", "device_name": "NVIDIA H200", "utterance": _utterance()}
    (job_dir / "utterances.jsonl").write_text(json.dumps(line) + "\n")
    refused("its utterances were timed on 'NVIDIA H200'",
            "resuming would mix measurements of different devices")  # fmt: skip
    # the job folder is gone
    shutil.rmtree(job_dir)
    refused(f"cannot resume run {rid}: its job folder", "is gone")
    (row,) = store.list_runs()  # nothing was written by any refusal
    assert row["id"] == run_id and row["status"] == "FAILED"
    store.close()


def _utterance() -> dict[str, Any]:
    return {
        "prompt_id": "a", "seed": 42, "round": 0, "latency_s": 0.1, "lm_s": 0.08,
        "codec_s": 0.02, "prompt_tokens": 10, "new_tokens": 32, "frames": 4, "audio_s": 0.32,
        "stop_reason": "length_policy",
    }  # fmt: skip
