"""Per-slot time: families time their slots over one short synthesis and leave the engine
exactly as it was; the worker stores it as slot_ms.<slot>; the `profile` proposer spends
the next jobs on the costliest slot."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import require_or_skip

from orchestrate.api.config import (
    LengthPolicy,
    ModelSpec,
    StackSpec,
    TechniqueRef,
    Workload,
    load_workload,
)
from orchestrate.api.proposer import ExplorationState, Tried
from orchestrate.api.records import JobSpec, StackResult
from orchestrate.api.registry import build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.explore.state import technique_catalogue
from orchestrate.families.rumik import profile as rumik_profile
from orchestrate.families.rumik.engine import masked_sdpa
from orchestrate.proposers.profile import ProfileProposer
from orchestrate.running import worker


@pytest.fixture(autouse=True)
def _short(monkeypatch):
    monkeypatch.setattr(rumik_profile, "FRAMES", 2)  # 16 decode steps: seconds on 2 cores
    monkeypatch.setattr(rumik_profile, "WARMUPS", 1)


@pytest.fixture(scope="module")
def rumik():
    return get_family("rumik")


@pytest.fixture(scope="module")
def smoke() -> Workload:
    """The smoke prompts at 4 frames a clip: the before/after comparisons stay short."""
    return load_workload("smoke").model_copy(
        update={"length_policy": LengthPolicy(mode="fixed", frames=4)}
    )


def rumik_engine(rumik, tiny_model, *names: str):
    spec = StackSpec(name="s", techniques=[TechniqueRef(name=n) for n in names])
    return rumik.build_engine(tiny_model, build_stack(spec, DeviceCaps("cpu")))


def fields(engine) -> dict[str, object]:
    return {k: v for k, v in vars(engine).items() if k != "filled"}


def audio(family, engine, wl: Workload) -> np.ndarray:
    return family.synthesize(engine, wl.prompts[0].text, wl.seeds[0], wl).audio


# ------------------------------------------------------------------ Rumik, on CPU


def test_stock_rumik_profile_times_the_slots_it_calls(rumik, tiny_model, smoke):
    engine = rumik_engine(rumik, tiny_model)
    before, parts = audio(rumik, engine, smoke), fields(engine)
    ms = rumik.slot_profile(engine, smoke.prompts[0].text, smoke.seeds[0], smoke)
    # The stock decoder is transformers' forward: it never reads projections or attention.
    assert set(ms) == {"decoder", "head", "sampler", "loop"}
    assert all(v > 0 for v in ms.values())
    assert all(fields(engine)[k] is v for k, v in parts.items())  # the same objects back
    assert np.array_equal(audio(rumik, engine, smoke), before)  # and the same output


def test_static_decoder_parts_are_timed_and_restored(rumik, tiny_model, smoke):
    engine = rumik_engine(rumik, tiny_model, "static_kv_cache")
    before = audio(rumik, engine, smoke)
    decoder = engine.new_decoder(64)  # the one decoder static_kv_cache reuses
    ms = rumik.slot_profile(engine, smoke.prompts[0].text, smoke.seeds[0], smoke)
    assert {"decoder", "projections", "attention", "head", "sampler", "loop"} <= set(ms)
    assert all(v > 0 for v in ms.values())
    assert decoder.attend is masked_sdpa  # the decoder's own reference, put back
    assert not {"qkvgu", "residual"} & set(vars(engine.projections))
    assert not {"prefill", "step"} & set(vars(decoder))
    assert np.array_equal(audio(rumik, engine, smoke), before)


def test_a_failing_synthesis_still_restores_the_engine(rumik, tiny_model, smoke):
    engine = rumik_engine(rumik, tiny_model)
    parts = fields(engine)

    def broken(*args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        rumik_profile.slot_profile(engine, "x", 1, smoke, broken)
    assert all(fields(engine)[k] is v for k, v in parts.items())


def test_worker_stores_slot_ms_only_when_asked(rumik, tiny_model, smoke, tmp_path):
    spec = StackSpec(name="stock")
    engines = {"stock": rumik_engine(rumik, tiny_model)}
    results = {"stock": StackResult(stack=spec, status="ok")}
    job = JobSpec(
        model=ModelSpec(preset="tiny"), workload=smoke, stacks=[spec], output_dir=str(tmp_path)
    )
    assert worker._slot_metrics(job, rumik, engines, results, smoke) == {}
    asked = job.model_copy(update={"profile_slots": True})
    out = worker._slot_metrics(asked, rumik, engines, results, smoke)["stock"]
    assert set(out) == {"slot_ms.decoder", "slot_ms.head", "slot_ms.sampler", "slot_ms.loop"}

    class Broken:
        def slot_profile(self, *args):
            raise RuntimeError("no timer here")

    assert worker._slot_metrics(asked, Broken(), engines, results, smoke) == {}


def test_worker_counts_launches_of_the_stacks_the_job_names(smoke):
    """count_launches: None counts every stack, a list only those (an exploration's dev job
    names its candidates: stock's count is the same in every job and the slowest to take)."""

    class Counting:
        def __init__(self):
            self.counted = []

        def launches_per_step(self, engine, text, seed, wl):
            self.counted.append(engine)
            return {"launches_per_step": 1.0}

    results = {n: StackResult(stack=StackSpec(name=n), status="ok") for n in ("stock", "c")}
    engines = {"stock": "stock-engine", "c": "c-engine"}
    cuda = torch.device("cuda")  # the counter only runs on a GPU; this fake needs none
    family = Counting()
    out = worker._launch_metrics(family, engines, results, smoke, cuda)
    assert set(out) == {"stock", "c"} and family.counted == ["stock-engine", "c-engine"]
    family = Counting()
    out = worker._launch_metrics(family, engines, results, smoke, cuda, ["c"])
    assert set(out) == {"c"} and family.counted == ["c-engine"]


# ------------------------------------------------------------------ OmniVoice, on CPU


def test_omnivoice_profile_splits_the_stock_loop(family, model):
    require_or_skip("omnivoice")  # a broken install fails under ORCHESTRATE_REQUIRE_QUALITY
    from orchestrate.families.omnivoice.engine import package_loop, stock_engine

    wl = Workload(
        name="t",
        prompts=[{"id": "a", "text": "The morning train was late again."}],
        seeds=[11],
        warmups=0,
        length_policy={"mode": "fixed", "frames": 5},
        measure_ttfa=False,
    )
    engine = stock_engine(model)
    engine.knobs["num_step"] = 8  # the package's own loop still, at a quarter of the steps
    before = audio(family, engine, wl)
    ms = family.slot_profile(engine, wl.prompts[0].text, 11, wl)
    assert {"forward", "guidance", "unmask", "codec"} <= set(ms)
    assert all(v > 0 for v in ms.values())
    assert engine.loop is package_loop  # slot_loop stood in for the profile only
    assert not {"uncond_rows", "log_probs"} & set(vars(engine.guidance))
    assert np.array_equal(audio(family, engine, wl), before)


# ------------------------------------------------------------- the profile proposer


def state(champion: list[str], profile: dict[str, float], tried=(), caps=("cpu",)):
    spec = StackSpec(name="champ", techniques=[TechniqueRef(name=n) for n in champion])
    return ExplorationState(
        family="rumik",
        device="cpu",
        device_caps=list(caps),
        champion=spec,
        champion_headline=1.0,
        root=StackSpec(name="stock"),
        min_speedup=1.05,
        catalogue=technique_catalogue("rumik"),
        tried=list(tried),
        profile=profile,
    )


def tried_of(proposal) -> Tried:
    return Tried(proposal.stack, proposal.change, "profile", "drop", "slower")


def test_proposes_for_the_costliest_slot_exact_first():
    st = state([], {"decoder": 5.0, "head": 9.0, "sampler": 1.0})
    proposals = ProfileProposer().propose(st, 5)
    assert [p.change for p in proposals] == ["+audio_head", "+codebook_head"]  # exact first
    assert "'head'" in proposals[0].reason and "9 ms" in proposals[0].reason
    for p in proposals:
        build_stack(p.stack)


def test_next_slot_when_the_costliest_is_spent():
    first = ProfileProposer().propose(state([], {"decoder": 5.0, "head": 9.0}), 5)
    st = state([], {"decoder": 5.0, "head": 9.0}, tried=[tried_of(p) for p in first])
    [p] = ProfileProposer().propose(st, 5)  # cuda_graph wraps decoder but needs CUDA
    assert p.change == "+static_kv_cache"


def test_device_and_order_decide_what_fits():
    cuda = ("cpu", "cuda")
    [p] = ProfileProposer().propose(state(["static_kv_cache"], {"decoder": 5.0}, caps=cuda), 5)
    assert p.change == "+cuda_graph"  # wraps the decoder, after static_kv_cache: on a GPU
    assert ProfileProposer().propose(state(["static_kv_cache"], {"decoder": 5.0}), 5) == []


def test_a_filled_slot_is_swapped_not_doubled():
    [p] = ProfileProposer().propose(state(["audio_head"], {"head": 3.0}), 5)
    assert p.change == "-audio_head+codebook_head"
    assert [t.name for t in p.stack.techniques] == ["codebook_head"]


def test_pending_and_refused_here_are_not_proposed():
    """Another proposer's proposal of this round is not made twice, and a technique whose
    step could not run on this device is not proposed again."""
    [audio, codebook] = ProfileProposer().propose(state([], {"head": 9.0}), 5)
    pending = dataclasses.replace(state([], {"head": 9.0}), pending=[audio.stack])
    assert [p.change for p in ProfileProposer().propose(pending, 5)] == ["+codebook_head"]
    refused = Tried(codebook.stack, "+codebook_head", "ladder", "error", "refused: not here")
    gone = state([], {"head": 9.0}, tried=[refused])
    assert [p.change for p in ProfileProposer().propose(gone, 5)] == ["+audio_head"]


def test_a_change_slower_beyond_noise_is_not_made_again_on_a_later_champion():
    """The H200 exploration from stock swapped cuda_graph for graph_loop on four champions
    in a row, 0.81x to 0.89x each. A change whose paired CI lay wholly below 1 is not
    proposed again; one whose CI reached 1 (no evidence either way) still is."""
    champion = ["static_kv_cache", "device_sampler", "graph_loop"]
    cuda = GPU
    [swap] = ProfileProposer().propose(state(champion, {"decoder": 5.0}, caps=cuda), 1)
    assert swap.change == "+cuda_graph (instead of graph_loop)"
    earlier = StackSpec(name="older", techniques=[TechniqueRef(name="audio_head")])

    def lost(hi: float) -> Tried:  # the same change, made on an earlier champion
        return Tried(earlier, swap.change, "profile", "drop", "slower", vs_parent=0.85,
                     vs_parent_hi=hi)  # fmt: skip

    later = state([*champion, "decode_attention"], {"decoder": 5.0}, [lost(0.93)], cuda)
    assert later.lost_moves() == {swap.change}
    assert swap.change not in [p.change for p in ProfileProposer().propose(later, 5)]
    unsure = state([*champion, "decode_attention"], {"decoder": 5.0}, [lost(1.02)], cuda)
    assert unsure.lost_moves() == set()
    assert [p.change for p in ProfileProposer().propose(unsure, 1)] == [swap.change]


def test_empty_profile_proposes_nothing():
    assert ProfileProposer().propose(state([], {}), 5) == []


# ------------------------------------------------ host work: the GPU idle most of a step

GPU = ("cpu", "cuda", "package:triton", "sm90")


def test_a_host_bound_champion_gets_the_step_captured_first():
    """Stock on the H200: the GPU busy 4.7 of 26.3 ms a token. Every slot's time is then
    mostly host work, so the techniques that capture the step come first, bringing what
    they need, even though the decoder slot costs more than the host figure."""
    st = state([], {"decoder": 23.0, "head": 2.0, "loop": 1.3, "host": 21.6}, caps=GPU)
    proposals = ProfileProposer().propose(st, 5)
    changes = [p.change for p in proposals]
    assert changes[0] == "+cuda_graph (with static_kv_cache)"  # exact first
    assert "+graph_loop (with static_kv_cache, device_sampler)" in changes
    assert all("reduces" in p.reason and "idle 21.6 ms" in p.reason for p in proposals)
    for p in proposals:
        build_stack(p.stack)


def test_a_gpu_bound_champion_is_profiled_by_its_slots():
    """After the capture the host share is small: the costliest slot leads again. Without a
    capture in the champion, host work that costs more than the slots leads."""
    champ = ["static_kv_cache", "device_sampler", "graph_loop"]
    st = state(champ, {"decoder": 1.5, "head": 0.3, "host": 0.1}, caps=GPU)
    [first, *_] = ProfileProposer().propose(st, 5)
    assert "decoder" in first.reason and "idle" not in first.reason
    st = state(["static_kv_cache"], {"decoder": 0.2, "host": 3.0}, caps=GPU)
    [capture, *_] = ProfileProposer().propose(st, 5)
    assert capture.change == "+cuda_graph" and "idle 3 ms" in capture.reason


def test_reduces_names_only_costs_the_profile_knows(monkeypatch):
    """A plugin declaring it reduces something the profile never measures is broken, with
    the reason, not silently never proposed."""
    from importlib.metadata import EntryPoint

    from orchestrate.api import registry
    from orchestrate.api.registry import StackError
    from orchestrate.techniques.rumik.cuda_graph import CudaGraph

    class Lies(CudaGraph):
        name = "lies"
        reduces = ("memory",)

    ep = EntryPoint("lies", "x:Lies", registry.TECHNIQUES)
    monkeypatch.setattr(EntryPoint, "load", lambda self: Lies)
    families = {"rumik": get_family("rumik")}
    with pytest.raises(StackError, match="reduces.*memory.*host"):
        registry._load_technique(ep, families, {})


def test_a_captured_slot_is_not_chased():
    """graph_loop's `loop` slot holds the replayed step (4.63 of 4.86 ms a token on the
    H200): the next costliest slot is proposed for, not other loops."""
    champ = ["static_kv_cache", "device_sampler", "graph_loop", "packed_projections"]
    profile = {"loop": 4.63, "decoder": 0.114, "attention": 0.065, "host": 0.513}
    proposals = ProfileProposer().propose(state(champ, profile, caps=GPU), 5)
    assert proposals and all("loop" not in p.reason and "idle" not in p.reason for p in proposals)
    assert "'decoder'" in proposals[0].reason
