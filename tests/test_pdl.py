"""The pdl technique (refused without Hopper, never a silent no-op) and launch counting.

CPU-only checks of validation and wiring; tests/test_gpu.py runs PDL stacks on the H200.
"""

from __future__ import annotations

import pytest

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.rumik.engine import stock_engine
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


def test_pdl_switches_every_kernel_part_on(tiny_model):
    names = ("static_kv_cache", "int8_projections", "fused_rope_norm", "device_sampler", "pdl")
    eng = FAMILY.build_engine(tiny_model, build_stack(stack(*names)))
    assert eng.projections.pdl is True and eng.sampler.pdl is True and eng.notes["pdl"] is True
    assert eng.notes["pdl_switched"] == ["int8_projections", "device_sampler", "fused_rope_norm"]
    assert build_stack(stack(*names)).exact is False  # int8 and the sampler, not pdl
    assert PDL.exact is True


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

    counts = iter([{"kernels": 30, "launches": 5}, {"kernels": 30, "launches": 5}])
    monkeypatch.setattr(launches, "count_launches", lambda fn, device: (fn(), next(counts))[1])
    out = launches.per_step(lambda frames: frames * 8, torch.device("cuda"))
    assert out == {"launches_per_step": 0.0}
    counts = iter([{"kernels": 30, "launches": 5}, {"kernels": 90, "launches": 21}])
    out = launches.per_step(lambda frames: frames * 8, torch.device("cuda"))
    assert out == {"launches_per_step": 1.0, "kernels_per_step": 3.75}
