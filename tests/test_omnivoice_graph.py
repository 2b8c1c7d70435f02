"""cuda_graph_loop: the eager step function equals slot_loop (CPU), the graph replays it.

The CPU tests run the loop's step function eagerly (no capture) with position and class
temperature 0, where slot_loop is deterministic: the codes must be identical. The GPU tests
capture the same steps and compare again, then check replays and seeds.
"""

# ruff: noqa: E402 -- imports follow require_or_skip: they need omnivoice
from __future__ import annotations

import pytest
import torch
from conftest import require_or_skip

require_or_skip("omnivoice")  # needs a torchaudio that matches torch


from orchestrate.api.config import ModelSpec, Prompt, StackSpec, TechniqueRef, Workload, load_stack
from orchestrate.api.registry import StackError, build_stack, get_family
from orchestrate.api.technique import DeviceCaps
from orchestrate.families.omnivoice.engine import Engine, Loop, Passes, slot_loop, stock_engine
from orchestrate.techniques.omnivoice.cuda_graph_loop import CudaGraphLoop, GraphLoop
from orchestrate.techniques.omnivoice.torch_compile import compile_forward
from orchestrate.techniques.omnivoice.use_cache_off import no_cache_forward

TEXT = "The morning train was late again."
LONG = "She opened the letter slowly, unsure whether she wanted to know what it said."
RECIPE = {"num_step": 10, "guidance_scale": 2.5}
GREEDY = {"position_temperature": 0.0, "class_temperature": 0.0}
H200 = DeviceCaps("cuda", (9, 0), "NVIDIA H200")


def engine(model, loop: Loop, batch: int = 1, cache_off: bool = True, **knobs) -> Engine:
    """slot_loop's engine (or the same with a GraphLoop), knobs set directly: the technique
    itself needs CUDA, so on the CPU its loop is wired in by hand."""
    eng = stock_engine(model, reimplemented=True)
    eng.knobs.update(knobs)
    if cache_off:
        eng.forward = no_cache_forward(model.ov)
    eng.loop, eng.batch = loop, batch
    return eng


def run(eng: Engine, texts: list[str], seed: int = 11) -> list[torch.Tensor]:
    task = eng.model.ov._preprocess_all(text=texts)
    torch.manual_seed(seed)
    return eng.loop(eng, task, eng.config())


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and torch.equal(x.cpu(), y.cpu())


# ------------------------------------------------------------- eager proof (CPU)


@pytest.mark.parametrize("cache_off", [True, False], ids=["use_cache_off", "package_forward"])
@pytest.mark.parametrize("knobs", [RECIPE, {}], ids=["recipe", "package_defaults"])
def test_eager_steps_equal_slot_loop(model, knobs, cache_off):
    ref = run(engine(model, slot_loop, cache_off=cache_off, **knobs, **GREEDY), [TEXT])
    eng = engine(model, GraphLoop(), cache_off=cache_off, **knobs, **GREEDY)
    assert_same(run(eng, [TEXT]), ref)
    steps = knobs.get("num_step", 32)
    assert eng.passes.last == Passes(steps=steps, rows=2 * steps)


def test_eager_steps_equal_slot_loop_batched(model):
    """B>1: the batch technique's identical copies, and items of different lengths (the
    gather path: other prompt lengths, other target lengths, padded rows)."""
    for texts in ([TEXT] * 3, [TEXT, LONG, "Yes."]):
        ref = run(engine(model, slot_loop, **RECIPE, **GREEDY), texts)
        eng = engine(model, GraphLoop(), **RECIPE, **GREEDY)
        got = run(eng, texts)
        assert_same(got, ref)
        assert eng.passes.last == Passes(steps=10, rows=10 * 2 * len(texts))
    assert len({c.shape[-1] for c in got}) == 3  # really three lengths


def test_eager_noise_is_seeded_and_every_position_commits(model):
    eng = engine(model, GraphLoop(), class_temperature=1.0, **RECIPE)  # position noise on
    a, again, other = (run(eng, [TEXT, TEXT], seed=s) for s in (1, 1, 2))
    assert_same(a, again)
    assert not torch.equal(a[0], other[0])
    assert all(not bool((c == model.ov.config.audio_mask_id).any()) for c in a)


def test_static_loops_are_kept_per_shape(model):
    loop = GraphLoop()
    eng = engine(model, loop, **RECIPE, **GREEDY)
    run(eng, [TEXT])
    run(eng, [TEXT])
    run(eng, [LONG])
    eng.knobs["num_step"] = 4  # another step count is other work: another loop
    run(eng, [TEXT])
    assert len(loop.loops) == 3
    technique = CudaGraphLoop(CudaGraphLoop.Params())
    a, b = stock_engine(model), stock_engine(model)
    technique.apply(a)
    technique.apply(b)
    assert isinstance(a.loop, GraphLoop) and a.loop is not b.loop  # each engine its own


def test_synthesis_reports_the_forwards_it_ran(model):
    family = get_family("omnivoice")
    wl = Workload(
        name="t",
        prompts=[Prompt(id="p", text=TEXT)],
        seeds=[11],
        warmups=0,
        length_policy={"mode": "model"},
        measure_ttfa=False,
    )
    eng = engine(model, GraphLoop(), batch=2, **RECIPE)
    syn = family.synthesize(eng, TEXT, 11, wl)
    assert syn.forward_passes == 10 and syn.frames > 0
    assert eng.passes.last == Passes(steps=10, rows=40)


# ------------------------------------------------------------------- refusals


def spec(*techniques: dict) -> StackSpec:
    return StackSpec(
        name="s", family="omnivoice", techniques=[TechniqueRef(**t) for t in techniques]
    )


def test_needs_cuda():
    built = build_stack(load_stack("ov-graph"), DeviceCaps("cpu"))
    assert "needs a CUDA device" in built.skipped["cuda_graph_loop"]
    with pytest.raises(StackError, match="cuda_graph_loop.*cannot run here.*CUDA"):
        build_stack(spec({"name": "cuda_graph_loop"}), DeviceCaps("cpu"), strict=True)


@pytest.mark.parametrize("name", ["ov-graph", "ov-graph-b2", "ov-graph-b4", "ov-graph-b8"])
def test_experiment_stacks_build_for_a_gpu(name):
    built = build_stack(load_stack(name), H200, strict=True)
    names = [t.name for t in built.techniques]
    assert names[:5] == ["num_step", "guidance_scale", "use_cache_off", "torch_compile",
                         "cuda_graph_loop"]  # fmt: skip
    assert built.techniques[3].params.mode == "default" and not built.exact


def test_reduce_overhead_compile_is_refused(model):
    compiled = {"name": "torch_compile", "params": {"mode": "reduce-overhead"}}
    with pytest.raises(StackError, match="reduce-overhead.*cannot be captured"):
        build_stack(spec(compiled, {"name": "cuda_graph_loop"}), H200)
    # Listed after the loop, check_stack cannot see it: the loop refuses before any work.
    build_stack(spec({"name": "cuda_graph_loop"}, compiled), H200)
    eng = engine(model, GraphLoop(), **RECIPE)
    eng.forward = compile_forward(eng.forward, "reduce-overhead", fullgraph=False)
    with pytest.raises(RuntimeError, match="reduce-overhead.*mode default"):
        run(eng, [TEXT])


def test_guidance_and_unmask_fillers_are_refused(model):
    for other in ("cfg_late_off", "confidence_parallel"):
        with pytest.raises(StackError, match=f"cuda_graph_loop.*conflicts with {other!r}"):
            build_stack(spec({"name": other}, {"name": "cuda_graph_loop"}), H200)
    eng = engine(model, GraphLoop(), **RECIPE)
    eng.filled["guidance"] = "cfg_late_off"  # listed after the loop: refused when run
    with pytest.raises(RuntimeError, match="cfg_late_off.*'guidance' slot"):
        run(eng, [TEXT])


# ------------------------------------------------------------------- captured (GPU)


@pytest.fixture(scope="module")
def cuda_model():
    return get_family("omnivoice").build_model(
        ModelSpec(family="omnivoice", preset="tiny", device="cuda")
    )


def graph_engine(model, *techniques: dict, batch: int = 1, **knobs) -> Engine:
    """The technique through the registry on CUDA (use_cache_off + cuda_graph_loop); the
    temperatures are set as knobs (class_temperature has no technique)."""
    stack = spec(
        *({"name": k, "params": {"value": v}} for k, v in RECIPE.items()),
        {"name": "use_cache_off"},
        *techniques,
        {"name": "cuda_graph_loop"},
        {"name": "batch", "params": {"size": batch}},
    )
    eng = get_family("omnivoice").build_engine(model, build_stack(stack, DeviceCaps.probe("cuda")))
    assert isinstance(eng.loop, GraphLoop)
    eng.knobs.update(knobs)
    return eng


def graphs(eng: Engine) -> list[torch.cuda.CUDAGraph]:
    assert isinstance(eng.loop, GraphLoop)
    return [loop.graph for loop in eng.loop.loops.values()]


@pytest.mark.gpu
def test_graph_loop_captured_equals_slot_loop_on_cuda(cuda_model):
    """Deterministic settings, the same eager forward kernels on both sides: the captured
    loop's codes are slot_loop's, for one item, batch copies and mixed lengths; a second
    replay with the same inputs gives the same codes."""
    for texts in ([TEXT], [TEXT] * 4, [TEXT, LONG]):
        ref = run(engine(cuda_model, slot_loop, **RECIPE, **GREEDY), texts)
        eng = graph_engine(cuda_model, batch=len(texts), **GREEDY)
        first = run(eng, texts)
        assert graphs(eng) and all(g is not None for g in graphs(eng))  # really captured
        assert_same(first, ref)
        assert_same(run(eng, texts), first)  # replay
        assert eng.passes.last == Passes(steps=10, rows=20 * len(texts))


@pytest.mark.gpu
def test_graph_loop_replays_are_seeded_on_cuda(cuda_model):
    """Noise on (Philox inside the graph): the same seed replays the same codes (the
    capturing call included), another seed gives other codes, nothing stays masked."""
    eng = graph_engine(cuda_model, batch=2, class_temperature=1.0)
    a, again, other = (run(eng, [TEXT, TEXT], seed=s) for s in (1, 1, 2))
    assert len(graphs(eng)) == 1
    assert_same(a, again)
    assert not torch.equal(a[0], other[0])
    assert not torch.equal(a[0], a[1])  # the copies draw their own noise
    assert all(not bool((c == cuda_model.ov.config.audio_mask_id).any()) for c in a)


@pytest.mark.gpu
def test_graph_loop_over_compiled_forward_on_cuda(cuda_model):
    """torch_compile mode default composes: compiled in the warm-up, captured in the graph.
    (Codes are not compared with eager: a last-bit difference may flip an argmax.)"""
    compiled = {"name": "torch_compile", "params": {"mode": "default"}}
    eng = graph_engine(cuda_model, compiled, **GREEDY)
    first = run(eng, [TEXT])
    assert_same(run(eng, [TEXT]), first)
    assert eng.forward.shapes_seen  # type: ignore[attr-defined]
    ref = run(engine(cuda_model, slot_loop, **RECIPE, **GREEDY), [TEXT])
    assert first[0].shape == ref[0].shape
