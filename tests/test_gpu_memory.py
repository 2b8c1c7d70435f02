"""GPU memory per stack (running/gpu_memory.py): the arithmetic against a simulated
allocator here, the real allocator through a worker job on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrate.api.config import LengthPolicy, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.running import gpu_memory
from orchestrate.running.gpu_memory import StackMemory


class FakeAllocator:
    def __init__(self) -> None:
        self.live = self.peak = 0

    def alloc(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def reset(self, *_: object) -> None:
        self.peak = self.live


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: a.live)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *_: a.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset)
    return a


def test_each_stack_is_charged_its_own_engine_and_transient(fake: FakeAllocator) -> None:
    mem = StackMemory(torch.device("cuda"))
    fake.alloc(7_000_000_000)  # the shared model
    mem.model_built()
    with mem.holding("int8"):
        fake.alloc(3_000_000_000)  # its int8 copies, kept
    with mem.holding("stock"):
        pass
    with mem.holding("int8"):  # its warm-up: a static cache, kept
        fake.alloc(500_000_000)
    for stack, activations in (("int8", 200_000_000), ("stock", 900_000_000)):
        for scale in (1, 2):  # two utterances: the larger counts
            with mem.timing(stack):
                fake.alloc(scale * activations)
                fake.alloc(-scale * activations)  # freed before the utterance ends
    int8, stock = mem.metrics("int8"), mem.metrics("stock")
    assert int8 == pytest.approx(
        {"gpu_model_gb": 7.0, "gpu_engine_gb": 3.5, "gpu_transient_gb": 0.4, "gpu_needed_gb": 10.9}
    )
    # stock runs after int8 was built, in the same process: none of int8's memory is its own
    assert stock == pytest.approx(
        {"gpu_model_gb": 7.0, "gpu_engine_gb": 0.0, "gpu_transient_gb": 1.8, "gpu_needed_gb": 8.8}
    )
    assert mem.metrics("never-built") == {}


def test_nothing_is_reported_off_the_gpu() -> None:
    mem = StackMemory(torch.device("cpu"))
    mem.model_built()
    with mem.holding("s"), mem.timing("s"):
        torch.zeros(1000)
    assert mem.metrics("s") == {}


@pytest.mark.gpu
def test_a_gpu_job_reports_each_stacks_memory(tmp_path) -> None:
    from orchestrate.api.config import load_model_spec
    from orchestrate.api.protocol import load_protocol
    from orchestrate.running.plan import plan_job
    from orchestrate.running.worker import run_job

    wl = Workload(
        name="mem", prompts=[Prompt(id="a", text="A first one."), Prompt(id="b", text="Two.")],
        seeds=[1], warmups=1, length_policy=LengthPolicy(mode="fixed", frames=4),
        save_audio=0, measure_ttfa=False,
    )  # fmt: skip
    model = load_model_spec("tiny").model_copy(update={"device": "cuda"})
    cached = StackSpec(name="cached", techniques=[TechniqueRef(name="static_kv_cache")])
    job = plan_job(model, wl, [StackSpec(name="stock"), cached], load_protocol(), Path(tmp_path),
                   fidelity_steps=0)  # fmt: skip
    by = {r.stack.name: r.metrics for r in run_job(job).results}
    for m in by.values():
        assert set(gpu_memory.METRICS) <= set(m)
        parts = m["gpu_model_gb"] + m["gpu_engine_gb"] + m["gpu_transient_gb"]
        assert m["gpu_needed_gb"] == pytest.approx(parts)
        assert m["gpu_model_gb"] > 0 and m["gpu_transient_gb"] > 0
    assert by["cached"]["gpu_engine_gb"] > 0  # its static cache
    # The first stack warmed up also keeps what the process allocates on first use: on the
    # H200 stock kept 34.6 MB here (cuBLAS's 32 MiB workspace), the cached engine 5.3 MB.
    assert by["stock"]["gpu_engine_gb"] >= 0
