"""The pdl technique (refused without Hopper, never a silent no-op) and launch counting.

CPU-only checks of validation and wiring; tests/test_gpu.py runs PDL stacks on the H200.
"""

from __future__ import annotations

import pytest
import torch

from orchestrate.api.config import SamplingConfig, StackSpec, TechniqueRef
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik.engine import LaunchOptions, stock_engine
from orchestrate.techniques.rumik.fused_rope_norm import FusedRopeNormDecoder
from orchestrate.techniques.rumik.pdl import PDL

FAMILY = get_family("rumik")


def stack(*names: str) -> StackSpec:
    return StackSpec(name="t", techniques=[TechniqueRef(name=n) for n in names])


def test_pdl_refused_or_skipped_without_hopper():
    names = ("static_kv_cache", "int8_projections", "pdl")
    on_cpu = build_stack(stack(*names), DeviceCaps("cpu"))
    assert "needs a Hopper GPU (sm_90)" in on_cpu.skipped["pdl"]
    a100 = DeviceCaps("cuda", (8, 0), "NVIDIA A100")
    built = build_stack(stack(*names), a100)
    assert [t.name for t in built.techniques] == ["static_kv_cache", "int8_projections"]
    assert "sm_80" in built.skipped["pdl"] and built.partial
    with pytest.raises(StackError, match="'pdl' cannot run here: needs a Hopper GPU"):
        build_stack(stack(*names), a100, strict=True)
    h200 = DeviceCaps("cuda", (9, 0), "NVIDIA H200")
    assert [t.name for t in build_stack(stack(*names), h200).techniques][-1] == "pdl"


def test_pdl_needs_a_kernel_technique_before_it():
    with pytest.raises(StackError, match="'pdl': no Triton kernel technique comes before it"):
        build_stack(stack("static_kv_cache", "packed_projections", "pdl"))
    with pytest.raises(StackError, match="no Triton kernel technique"):
        build_stack(stack("pdl", "static_kv_cache", "int8_projections"))


def test_pdl_sets_the_engine_launch_option_only(tiny_model):
    names = ("static_kv_cache", "int8_projections", "fused_rope_norm", "device_sampler")
    without = FAMILY.build_engine(tiny_model, build_stack(stack(*names)))
    eng = FAMILY.build_engine(tiny_model, build_stack(stack(*names, "pdl")))
    assert without.launch == LaunchOptions() and eng.launch == LaunchOptions(pdl=True)
    assert eng.filled["launch"] == "pdl" and eng.decoder_class.func is FusedRopeNormDecoder
    # the parts keep their own params; the engine option reaches them at call time
    assert eng.projections.pdl is False and eng.sampler.pdl is False
    assert eng.projections.launch_pdl is True and without.projections.launch_pdl is False
    assert build_stack(stack(*names, "pdl")).exact is False  # int8 and the sampler, not pdl
    assert PDL.exact is True


def test_kernel_parts_read_the_launch_option_at_call_time(tiny_model, monkeypatch):
    """Each Triton launch gets launch_pdl from the engine when it runs (the kernels are
    stubbed: only the flag they receive is checked)."""
    from orchestrate.techniques.rumik.kernels import int8_gemv, sampler

    seen: list[tuple[str, bool]] = []

    def gemv(rows, q, scale, *, launch_pdl=False, **_):
        seen.append(("gemv", launch_pdl))
        return torch.zeros(rows.shape[0], q.shape[0], dtype=rows.dtype)

    def sample(logits, counter, *, launch_pdl=False, **_):
        seen.append(("sampler", launch_pdl))
        return torch.zeros(1, dtype=torch.long)

    monkeypatch.setattr(int8_gemv, "int8_linear", gemv)
    monkeypatch.setattr(sampler, "sample_top_k", sample)
    names = ("static_kv_cache", "int8_projections", "device_sampler")
    eng = FAMILY.build_engine(tiny_model, build_stack(stack(*names)))
    hidden = torch.zeros(1, tiny_model.config.hidden_size, dtype=tiny_model.lm.dtype)
    head = eng.head(hidden, 0)
    gen = torch.Generator().manual_seed(0)

    def launch() -> None:
        eng.projections.qkvgu(0, hidden)
        eng.sampler(head, allow_end=False, force_end=False, sampling=SamplingConfig(),
                    generator=gen)  # fmt: skip

    launch()
    PDL(PDL.Params()).apply(eng)  # after the parts exist: they see it at their next call
    launch()
    assert seen == [("gemv", False), ("sampler", False), ("gemv", True), ("sampler", True)]


def test_pdl_with_nothing_to_switch_is_an_error(tiny_model):
    with pytest.raises(RuntimeError, match="no part of this engine launches Triton kernels"):
        PDL(PDL.Params()).apply(stock_engine(tiny_model))


# ------------------------------------------------------- launches per step (None on a CPU)


def test_launch_counts_are_gpu_only(tiny_model):
    import torch

    from orchestrate.api.config import Workload
    from orchestrate.api.device import count_launches, per_step

    cpu = torch.device("cpu")
    assert count_launches(lambda: None, cpu) is None
    assert per_step(lambda frames: frames * 8, cpu) is None
    eng = FAMILY.build_engine(tiny_model, build_stack(stack("static_kv_cache")))
    wl = Workload(name="w", prompts=[{"id": "a", "text": "Hello there."}], seeds=[1])
    assert FAMILY.launches_per_step(eng, "Hello there.", 1, wl) is None


def test_kernels_hidden_in_a_conditional_graph_are_not_reported_as_zero(monkeypatch):
    """Under while_graph CUPTI sees no kernels (they run inside a conditional node): the
    per-step kernel count is left out rather than reported as 0; launches still count."""
    import torch

    from orchestrate.api import device as launches

    same = {"kernels": 30, "launches": 5, "busy_us": 100.0}
    counts = iter([same, same])
    monkeypatch.setattr(launches, "count_launches", lambda fn, device: (fn(), next(counts))[1])
    out = launches.per_step(lambda frames: frames * 8, torch.device("cuda"))
    assert out == {"launches_per_step": 0.0}
    counts = iter([same, {"kernels": 90, "launches": 21, "busy_us": 420.0}])
    out = launches.per_step(lambda frames: frames * 8, torch.device("cuda"))
    # 16 more tokens: 60 kernels, 16 launches, 320 us of device time more
    assert out == {"launches_per_step": 1.0, "kernels_per_step": 3.75, "gpu_busy_ms_per_step": 0.02}


def test_gpu_busy_time_is_the_union_of_device_intervals():
    """Overlapping kernels (PDL, two streams) count once; gaps (host work) not at all."""
    from orchestrate.api.device import union_us

    assert union_us([]) == 0.0
    assert union_us([(0, 10), (20, 25)]) == 15.0  # the gap 10..20 is host time
    assert union_us([(0, 10), (5, 12), (6, 8)]) == 12.0  # overlaps once, nested inside
    assert union_us([(20, 25), (0, 10)]) == 15.0  # order of events does not matter
