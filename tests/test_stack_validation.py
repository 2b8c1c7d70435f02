"""Building a stack fails early and specifically; device requirements skip or refuse."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from orchestrate.api import registry
from orchestrate.api.config import StackSpec, TechniqueRef, load_stack
from orchestrate.api.registry import StackError, build_stack
from orchestrate.api.technique import DeviceCaps, Technique


def stack(*names: str, **params: dict) -> StackSpec:
    return StackSpec(
        name="t", techniques=[TechniqueRef(name=n, params=params.get(n, {})) for n in names]
    )


def test_builtins_discovered_through_entry_points():
    found = registry.discover()
    assert {"static_kv_cache", "packed_projections", "audio_head", "codebook_head"} <= set(found)
    assert found["codebook_head"].exact is False and found["audio_head"].exact is True


def test_unknown_technique():
    with pytest.raises(StackError, match="unknown technique 'warp_drive'; known: .*audio_head"):
        build_stack(stack("warp_drive"))


def test_bad_params():
    with pytest.raises(StackError, match="static_kv_cache.*max_seq_len"):
        build_stack(stack("static_kv_cache", static_kv_cache={"max_seq_len": 1}))
    with pytest.raises(StackError, match="colour.*Extra inputs"):
        build_stack(stack("packed_projections", packed_projections={"colour": "red"}))


def test_slot_conflict():
    with pytest.raises(StackError, match="'audio_head' and 'codebook_head' both fill the 'head'"):
        build_stack(stack("audio_head", "codebook_head"))


@pytest.mark.parametrize(
    "names",
    [["hf_generate_static", "static_kv_cache"], ["static_kv_cache", "packed_projections",
     "hf_generate_static"]],
)  # fmt: skip
def test_a_technique_that_stands_alone_takes_no_others_in_either_order(names):
    """Baseline B runs transformers' generate() on the model's own modules: with others in
    its stack they would not run, and the stack would be measured as if they did (an H200
    exploration proposed `-graph_loop+hf_generate_static` on a champion of four)."""
    stack = StackSpec(name="b-plus", techniques=[TechniqueRef(name=n) for n in names])
    with pytest.raises(StackError, match="'hf_generate_static' stands alone"):
        build_stack(stack)
    build_stack(StackSpec(name="b", techniques=[TechniqueRef(name="hf_generate_static")]))


def test_a_conflict_declared_by_either_technique_holds_in_either_order():
    """graph_loop declares the conflict with cuda_graph, cuda_graph does not: the stack that
    put cuda_graph after graph_loop used to validate and then fail in its warm-up on the
    H200 (exploration 0b81eb6cc7a9, candidate #1)."""
    loop = ("static_kv_cache", "device_sampler", "graph_loop")
    assert "graph_loop" not in registry.get("cuda_graph").conflicts  # declared one way only
    with pytest.raises(StackError, match="'cuda_graph' conflicts with 'graph_loop'"):
        build_stack(stack(*loop, "cuda_graph"))
    with pytest.raises(StackError, match="'graph_loop' conflicts with 'cuda_graph'"):
        build_stack(stack("static_kv_cache", "device_sampler", "cuda_graph", "graph_loop"))


def test_order_and_missing_dependency():
    with pytest.raises(StackError, match="needs 'static_kv_cache' applied before.*missing"):
        build_stack(stack("packed_projections"))
    with pytest.raises(StackError, match="later in the stack"):
        build_stack(stack("packed_projections", "static_kv_cache"))


def test_wrong_family():
    spec = StackSpec(name="t", family="omnivoice", techniques=[TechniqueRef(name="audio_head")])
    with pytest.raises(StackError, match="for the 'rumik' family"):
        build_stack(spec)


class _NeedsHopper(Technique):
    name = "needs_hopper"
    family = "rumik"
    exact = True
    slots: ClassVar = ("sampler",)
    requires: ClassVar = ("cuda", "sm90")

    def apply(self, engine):
        engine.sampler = engine.sampler


class _AfterHopper(_NeedsHopper):
    name = "after_hopper"
    slots: ClassVar = ("loop",)
    requires: ClassVar = ()
    after: ClassVar = ("needs_hopper",)


def with_techniques(monkeypatch, **extra: type) -> None:
    """The installed catalogue plus `extra` techniques, as if installed (no entry points)."""
    cat = registry.catalogue()
    fake = registry.Catalogue(cat.families, {**cat.techniques, **extra}, cat.broken)
    monkeypatch.setattr(registry, "catalogue", lambda: fake)


@pytest.fixture
def fake_plugins(monkeypatch):
    with_techniques(monkeypatch, needs_hopper=_NeedsHopper, after_hopper=_AfterHopper)


def test_cpu_skips_gpu_technique_and_its_dependents(fake_plugins):
    built = build_stack(stack("audio_head", "needs_hopper", "after_hopper"), DeviceCaps("cpu"))
    assert [t.name for t in built.techniques] == ["audio_head"]
    assert built.partial
    assert "CUDA" in built.skipped["needs_hopper"]
    assert "needs_hopper, which was skipped" in built.skipped["after_hopper"]


def test_strict_refuses(fake_plugins):
    with pytest.raises(StackError, match="needs_hopper' cannot run here: needs a CUDA device"):
        build_stack(stack("needs_hopper"), DeviceCaps("cpu"), strict=True)


def test_older_gpu_lacks_sm90():
    caps = DeviceCaps("cuda", (8, 0), "NVIDIA A100")
    assert "sm_80" in caps.missing("sm90")
    assert caps.missing("cuda") is None
    assert DeviceCaps("cuda", (9, 0), "NVIDIA H200").missing("sm90") is None
    assert "nonexistent_pkg_xyz" in DeviceCaps("cpu").missing("package:nonexistent_pkg_xyz")


@pytest.mark.parametrize("outer", ["cuda_graph", "graph_loop", "while_graph"])
def test_inductor_graphs_do_not_nest_in_ours(outer):
    h200 = DeviceCaps("cuda", (9, 0), "H200")
    names = ["static_kv_cache", "device_sampler", outer] if outer != "cuda_graph" else [
        "static_kv_cache", outer]  # fmt: skip
    ro = {"compile": True, "compile_mode": "reduce-overhead"}
    with pytest.raises(StackError, match="reduce-overhead.*own CUDA graphs"):
        build_stack(stack(*names, static_kv_cache=ro), h200)
    fused = {"compile": True, "compile_mode": "default"}  # kernels fused, launched by our graph
    built = build_stack(stack(*names, static_kv_cache=fused), h200)
    assert [t.name for t in built.techniques][-1] == outer


def test_one_loop_per_stack_and_no_while_graph_on_cpu():
    h200 = DeviceCaps("cuda", (9, 0), "H200")
    with pytest.raises(StackError, match="loop"):
        build_stack(stack("static_kv_cache", "device_sampler", "graph_loop", "while_graph"), h200)
    names = ("static_kv_cache", "device_sampler", "while_graph")
    assert [t.name for t in build_stack(stack(*names), h200).techniques][-1] == "while_graph"
    on_cpu = build_stack(stack(*names), DeviceCaps("cpu"))  # skipped with the reason, never
    assert "CUDA" in on_cpu.skipped["while_graph"]  # applied half-configured
    assert [t.name for t in on_cpu.techniques] == ["static_kv_cache"]


class _RefusesAtApply(_NeedsHopper):
    name = "refuses_at_apply"
    slots: ClassVar = ("head",)
    requires: ClassVar = ()

    def apply(self, engine):
        from orchestrate.api.technique import Refused

        raise Refused("this checkpoint's head is tied; refuses_at_apply needs it untied")


def test_a_technique_refusing_at_apply_is_recorded_refused_not_crashed(monkeypatch, tmp_path):
    from orchestrate.api.config import Workload, load_model_spec, load_workload
    from orchestrate.api.protocol import load_protocol
    from orchestrate.running.plan import plan_job
    from orchestrate.running.worker import run_job

    with_techniques(monkeypatch, refuses_at_apply=_RefusesAtApply)
    smoke = load_workload("smoke")
    wl = Workload.model_validate(
        smoke.model_dump() | {"prompts": smoke.prompts[:1], "seeds": [42], "warmups": 0}
    )
    refusing = stack("refuses_at_apply").model_copy(update={"name": "refusing"})
    job = plan_job(
        load_model_spec("tiny"), wl, [stack(), refusing], load_protocol(), tmp_path,
        fidelity_steps=0,
    )  # fmt: skip
    result = run_job(job)
    assert result.status == "partial"
    stock, refused = result.results
    assert stock.status == "ok" and stock.utterances
    assert refused.status == "refused" and "head is tied" in (refused.error or "")


@pytest.mark.parametrize(
    "path",
    sorted(str(p) for d in ("experiments", "benchmarks/stacks") for p in Path(d).glob("*.yaml")),
)
def test_every_shipped_stack_file_builds(path: str) -> None:
    """Each stack file in the repo names known techniques with valid params in a valid order
    (a benchmark stack is otherwise first read on the GPU host)."""
    spec = load_stack(path)
    built = sorted(t.name for t in build_stack(spec).techniques)
    assert built == sorted(ref.name for ref in spec.techniques), path  # stock ones are empty


def test_the_gemm_sweeps_stack_takes_only_the_shapes_that_won(tmp_path: Path):
    """benchmarks/ov_gemm_sweep.py --stack-out: the base stack with small_gemm where the
    fastest config beat cuBLAS by the margin, as params ov_packed_projections accepts; and
    no file at all when nothing won (an A/B of an unchanged stack would decide nothing)."""
    import importlib.util

    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("sweep", root / "benchmarks/ov_gemm_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)  # type: ignore[union-attr]
    cfg = {"block_m": 32, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4,
           "num_stages": 4}  # fmt: skip

    def shape(name: str, cublas_us: float, best_us: float) -> dict:
        rows = [{"kernel": "cublas", "config": None, "us": cublas_us},
                {"kernel": "small_gemm", "config": cfg, "us": best_us}]  # fmt: skip
        return {"name": name, "rows": sorted(rows, key=lambda r: r["us"])}

    report = {"rows": 156, "environment": {"device_name": "NVIDIA H200", "git_sha": "abc"},
              "shapes": [shape("qkv", 5.0, 4.0), shape("o_proj", 6.0, 5.9),
                         shape("down", 4.0, 7.0)]}  # fmt: skip
    base, out = root / "benchmarks/stacks/ov-best-packed-qkv.yaml", tmp_path / "ov-gemm.yaml"
    sweep.write_stack(report, base, out, 1.05)
    written = load_stack(str(out))
    packed = next(t for t in written.techniques if t.name == "ov_packed_projections")
    assert packed.params["small_gemm"] == {"qkv": cfg}  # 1.25x took it; 1.02x and slower not
    assert packed.params["fused_qkv_layout"] is True  # the rest of the base stack kept
    names = [t.name for t in load_stack(str(base)).techniques]
    assert [t.name for t in written.techniques] == names
    build_stack(written)  # the params validate
    none = tmp_path / "none.yaml"
    sweep.write_stack(report | {"shapes": report["shapes"][1:]}, base, none, 1.05)
    assert not none.exists()
