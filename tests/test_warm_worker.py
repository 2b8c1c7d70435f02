"""The warm worker (running.warm): one process runs many jobs, keeps the built model only
while its checksum holds, measures what a fresh worker measures, and a killed one is
reported as a fresh worker's death would be, the next job getting a new process.

Jobs use the tiny model on the CPU, 2 prompts x 1 seed, 4 frames, 4 fidelity steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrate.api.config import ModelSpec, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.protocol import load_protocol
from orchestrate.running import worker
from orchestrate.running.plan import plan_job
from orchestrate.running.runner import Outcome, execute, spawn_worker
from orchestrate.running.warm import WarmWorker
from orchestrate.store.store import Store

WORKLOAD = Workload(
    name="warm",
    prompts=[Prompt(id="a", text="A short first sentence."), Prompt(id="b", text="And more.")],
    seeds=[42],
    warmups=1,
    length_policy={"mode": "fixed", "frames": 4},
    save_audio=2,
)
STOCK = StackSpec(name="stock")
CACHED = StackSpec(name="cached", techniques=[TechniqueRef(name="static_kv_cache")])


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    # Pinned so the job identity does not move while others edit this tree.
    monkeypatch.setenv("ORCHESTRATE_CODE_SHA", "3a573a573a573a573a573a573a573a573a573a57")
    with Store(f"sqlite:///{tmp_path / 'o.db'}") as s:
        yield s


def run(store: Any, runs: Path, launch: Any, seed_shift: int = 0, **update: Any) -> Outcome:
    wl = WORKLOAD.model_copy(update={"seeds": [42 + seed_shift]})
    job = plan_job(
        ModelSpec(preset="tiny"), wl, [STOCK, CACHED], load_protocol("protocol"), runs,
        fidelity_steps=4,
    ).model_copy(update=update)  # fmt: skip
    return execute(job, store, runs, track=False, force=True, worker=launch)


def events(outcome: Outcome) -> list[dict[str, Any]]:
    assert outcome.result_path is not None
    path = outcome.result_path.with_name("events.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def pid(outcome: Outcome, runs: Path) -> int:
    return int((runs / outcome.result.job.job_id / "worker.pid").read_text())  # type: ignore[union-attr]


def audio(outcome: Outcome) -> dict[str, bytes]:
    assert outcome.result is not None and outcome.result_path is not None
    folder = outcome.result_path.parent
    return {
        f"{r.stack.name}/{u.prompt_id}": (folder / u.audio_path).read_bytes()
        for r in outcome.result.results
        for u in r.utterances
        if u.audio_path
    }


def test_jobs_share_one_process_and_measure_what_a_fresh_worker_measures(
    store: Any, tmp_path: Path
) -> None:
    warm = WarmWorker(tmp_path / "runs")
    try:
        first = run(store, tmp_path / "runs", warm)
        second = run(store, tmp_path / "runs", warm, seed_shift=1)
    finally:
        warm.close()
    assert first.status == second.status == "finished", (first.error, second.error)
    assert pid(first, tmp_path / "runs") == pid(second, tmp_path / "runs")
    said = [e.get("message", "") for e in events(second) if e["event"] == "status"]
    assert any(m.startswith("reusing tiny") for m in said), said
    assert not any(m.startswith("building tiny") for m in said), said
    # The same job in a fresh process writes the same audio, byte for byte.
    fresh = run(store, tmp_path / "fresh", launch=spawn_worker, seed_shift=1)
    assert fresh.status == "finished", fresh.error
    assert audio(fresh) == audio(second) and len(audio(second)) == 4
    assert warm.proc is None  # closed


def test_a_killed_warm_worker_is_reported_and_the_next_job_gets_a_fresh_one(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    warm = WarmWorker(runs)
    try:
        monkeypatch.setenv("ORCHESTRATE_FAULT", "kill_at:warmup")  # the process inherits it
        killed = run(store, runs, warm)
        monkeypatch.delenv("ORCHESTRATE_FAULT")
        after = run(store, runs, warm, seed_shift=1)
    finally:
        warm.close()
    assert killed.status == "FAILED" and killed.result is None
    assert killed.error is not None and killed.error.startswith("worker killed by SIGKILL")
    assert store.get_run(killed.run_id, utterances=False)["status"] == "FAILED"
    assert after.status == "finished", after.error
    killed_pid = int((_job_dir(store, killed.run_id, runs) / "worker.pid").read_text())
    assert killed_pid != pid(after, runs)


def _job_dir(store: Any, run_id: str, runs: Path) -> Path:
    return runs / store.get_run(run_id, utterances=False)["job_id"]


@dataclass
class Holder:
    """A model as families build one: a plain object holding torch modules."""

    net: torch.nn.Module
    preset: str = "toy"


class CountingFamily:
    def __init__(self) -> None:
        self.builds = 0

    def build_model(self, spec: Any) -> Holder:
        self.builds += 1
        torch.manual_seed(0)
        return Holder(torch.nn.Linear(4, 4))


def test_a_model_edited_in_place_is_built_again(capsys: pytest.CaptureFixture[str]) -> None:
    cache, family, spec = worker.ModelCache(), CountingFamily(), ModelSpec(preset="tiny")
    first = cache.get(family, spec)
    assert cache.get(family, spec) is first and family.builds == 1
    with torch.no_grad():  # what a technique that quantizes the shared model in place does
        first.net.weight[0, 0] += 1e-3
    again = cache.get(family, spec)
    assert again is not first and family.builds == 2
    assert "changed since the last job" in capsys.readouterr().out
    # Another model spec is another model.
    assert cache.get(family, spec.model_copy(update={"init_seed": 1})) is not again
    assert family.builds == 3


def test_a_model_without_torch_tensors_is_never_reused() -> None:
    class Onnxish:
        builds = 0

        def build_model(self, spec: Any) -> Any:
            self.builds += 1
            return type("M", (), {"graph": b"bytes"})()

    cache, family = worker.ModelCache(), Onnxish()
    cache.get(family, ModelSpec(preset="tiny"))
    cache.get(family, ModelSpec(preset="tiny"))
    assert family.builds == 2


def test_a_model_without_attributes_is_never_reused() -> None:
    """A third-party family's model may be a tuple or a __slots__ object: built afresh."""

    class Slotted:
        __slots__ = ("net",)

    class Family:
        builds = 0

        def build_model(self, spec: Any) -> Any:
            self.builds += 1
            return (torch.nn.Linear(2, 2),) if self.builds % 2 else Slotted()

    cache, family = worker.ModelCache(), Family()
    for _ in range(3):
        cache.get(family, ModelSpec(preset="tiny"))
    assert family.builds == 3 and worker.checksum(Slotted()) is None


def test_the_checksum_sees_every_tensor_and_a_one_ulp_change() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    before = worker.checksum(net)
    assert before is not None and len(before) == 2 * len(net.state_dict())
    with torch.no_grad():
        net[1].running_mean[1] = torch.nextafter(net[1].running_mean[1], torch.tensor(1.0))
    assert worker.checksum(net) != before


def test_a_worker_whose_job_failed_ends_and_the_next_job_gets_a_fresh_one(
    store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the result (the worker's answer is an error, not a death): the warm
    worker says it is its last job and exits, as after any failure (a CUDA error can leave
    a process unusable); the next job runs in a new process."""
    runs = tmp_path / "runs"
    warm = WarmWorker(runs)
    try:
        monkeypatch.setenv("ORCHESTRATE_FAULT", "enospc_at:result_write")
        failed = run(store, runs, warm)
        assert warm.proc is None  # reaped: it ended after that job
        monkeypatch.delenv("ORCHESTRATE_FAULT")
        after = run(store, runs, warm, seed_shift=1)
    finally:
        warm.close()
    assert failed.status == "FAILED" and failed.error is not None
    assert "no space left on device" in failed.error
    assert after.status == "finished", after.error
    failed_pid = int((_job_dir(store, failed.run_id, runs) / "worker.pid").read_text())
    assert failed_pid != pid(after, runs)


def test_a_job_planned_on_other_code_gets_a_fresh_process(store: Any, tmp_path: Path) -> None:
    """The process runs the code it imported; a job whose identity names other code (the
    tree was edited between jobs) must not be measured with the old."""
    runs = tmp_path / "runs"
    warm = WarmWorker(runs)
    try:
        first = run(store, runs, warm)
        same = run(store, runs, warm, seed_shift=1)
        edited = run(store, runs, warm, seed_shift=2, code_diff_hash="edited-since")
    finally:
        warm.close()
    assert {first.status, same.status, edited.status} == {"finished"}
    assert pid(first, runs) == pid(same, runs) != pid(edited, runs)


def test_a_job_of_other_stacks_keeps_the_process_an_edited_technique_does_not(
    store: Any, tmp_path: Path
) -> None:
    """Jobs of an exploration hold different stacks, so they name different techniques:
    that is no change of code (on the H200 the profile job of stock alone, then the dev
    job, each got a fresh process and paid stock's 22-29 s first warm-up again). A
    technique whose source differs from what an earlier job named is one."""
    runs = tmp_path / "runs"
    warm = WarmWorker(runs)
    try:
        alone = run(store, runs, warm, stacks=[STOCK], technique_code={})
        both = run(store, runs, warm, seed_shift=1)
        (name,) = both.result.job.technique_code  # type: ignore[union-attr]
        code = {name: {**both.result.job.technique_code[name], "source": "edited"}}  # type: ignore[union-attr]
        edited = run(store, runs, warm, seed_shift=2, technique_code=code)
    finally:
        warm.close()
    assert {alone.status, both.status, edited.status} == {"finished"}
    assert pid(alone, runs) == pid(both, runs) != pid(edited, runs)
