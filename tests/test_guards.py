"""Guards on measurements (running/guards.py): faster than the floor is invalid, audio that
ignores its input is flagged, a waveform is checked inside its time, a fidelity failure is
its stack's own error, and the host CPU is recorded; each said by `show` and its tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from factories import result_record, stack_result
from rich.console import Console

from orchestrate.api.config import LengthPolicy, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.family import Synthesis
from orchestrate.api.records import FidelityRecord, ResultRecord, StackResult
from orchestrate.reports import tables
from orchestrate.research.decide import judge
from orchestrate.running import environment, guards, metrics
from orchestrate.store.store import Store

STOCK = StackSpec(name="stock")
FAST = StackSpec(name="fast", techniques=[TechniqueRef(name="audio_head")])


def text(renderable: object) -> str:
    console = Console(record=True, width=250)
    console.print(renderable)
    return console.export_text()


def stored(result: ResultRecord) -> dict:
    """The run as `show` reads it: through the store (which keeps metrics, not guard fields)."""
    with Store("sqlite://") as s:
        return tables.annotate(s.get_run(s.ingest(result)))


# ----------------------------------------------------------------- faster than the floor


def with_floor(floor_ms: float) -> StackResult:
    res = stack_result(FAST, 0.5)
    res.metrics["floor_ms_per_token"] = floor_ms
    guards.mark(res)
    return res


def test_faster_than_the_floor_is_invalid_and_never_accepted():
    ms = stack_result(FAST, 0.5).metrics["ms_per_token"]
    fast = with_floor(ms * 1.01)  # 1% faster than moving its bytes at copy speed
    assert fast.invalid and "faster than its floor" in fast.invalid
    assert fast.metrics[metrics.INVALID] == 1.0
    verdict = judge(fast)
    assert verdict.verdict == "retain" and "INVALID" in verdict.causes["other"]
    # at or above the floor: a real measurement
    for ok in (with_floor(ms), with_floor(ms * 0.5)):
        assert ok.invalid is None and metrics.INVALID not in ok.metrics
        assert judge(ok).verdict == "accept"


def test_invalid_is_shown_from_stored_metrics():
    run = stored(result_record([stack_result(STOCK, 1.0), with_floor(1e3)]))
    fast = run["stacks"][1]
    assert fast["invalid"] and fast["warnings"][0].startswith("fast: INVALID:")
    shown = text(tables.stack_table("t", run["stacks"]))
    row = next(line for line in shown.splitlines() if line.strip().startswith("fast "))
    assert "INVALID" in row and "x [" not in row  # no speedup quoted for it
    assert "INVALID" not in next(ln for ln in shown.splitlines() if ln.strip().startswith("stock "))


def test_gpu_busy_time_is_a_column_beside_wall_time_when_measured():
    cpu = stored(result_record([stack_result(STOCK, 1.0), with_floor(1.0)]))
    assert "GPU-busy" not in text(tables.stack_table("t", cpu["stacks"]))  # CPU: no column
    for s, busy in zip(cpu["stacks"], (4.71, 1.613), strict=True):
        s["metrics"]["gpu_busy_ms_per_step"] = busy
    shown = text(tables.stack_table("t", cpu["stacks"]))
    assert "GPU-busy" in shown
    assert "4.71" in next(ln for ln in shown.splitlines() if ln.strip().startswith("stock "))
    assert "1.61" in next(ln for ln in shown.splitlines() if ln.strip().startswith("fast "))


# -------------------------------------------------------------------- waveform checked


def synthesis(audio: object) -> Synthesis:
    return Synthesis(0.5, 0.4, 0.1, None, 10, 80, 10, "length_policy", audio, 24_000)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "audio, why",
    [
        (np.array([0.1, np.nan, 0.2], np.float32), "non-finite waveform: 1 of 3"),
        (np.array([np.inf], np.float32), "non-finite"),
        (np.zeros(0, np.float32), "empty waveform"),
        ([0.1, 0.2], "not a host numpy array"),
    ],
)
def test_a_bad_waveform_is_an_error(audio, why):
    with pytest.raises(guards.BadWaveform, match=why):
        guards.check_waveform(synthesis(audio))


def test_the_check_is_inside_the_utterances_time():
    syn = synthesis(np.ones(48_000, np.float32))
    guards.check_waveform(syn)
    assert syn.latency_s > 0.5 and syn.codec_s > 0.1
    assert syn.latency_s - 0.5 == pytest.approx(syn.codec_s - 0.1)


# ---------------------------------------------------------------- audio and its input


def prints(*clips: tuple[str, str, int, np.ndarray]) -> guards.AudioPrints:
    p = guards.AudioPrints()
    for rnd, (pid, txt, seed, audio) in enumerate(clips):
        p.add("s", pid, txt, seed, rnd, audio, 24_000)
    return p


def test_same_audio_from_different_inputs_is_found():
    x = np.random.default_rng(0).standard_normal(24_000).astype(np.float32)
    same = prints(("a", "one", 1, x), ("a", "one", 2, x)).find("s")
    assert same and (same.a, same.b, same.differs_in) == ("a/seed 1", "a/seed 2", "seed")
    near = prints(("a", "one", 1, x), ("b", "two", 1, x + 1e-6)).find("s")
    assert near and near.differs_in == "prompt" and near.max_abs_diff < 1e-4
    # different prompts are reported before different seeds
    both = prints(("a", "one", 1, x), ("a", "one", 2, x), ("b", "two", 1, x)).find("s")
    assert both and both.differs_in == "prompt"


def test_different_audio_or_the_same_input_is_not_flagged():
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal(24_000).astype(np.float32) for _ in range(2))
    assert prints(("a", "one", 1, x), ("b", "two", 1, y)).find("s") is None
    assert prints(("a", "one", 1, x), ("a2", "one", 1, x)).find("s") is None  # same input
    assert prints(("a", "one", 1, x), ("b", "two", 1, x[:12_000])).find("s") is None  # length


def test_seed_codebooks_fills_them_or_says_there_are_none():
    import torch
    from transformers import MimiConfig, MimiModel

    from orchestrate.api.family import seed_codebooks
    from orchestrate.families.rumik.presets import PRESETS

    cfg = MimiConfig(**PRESETS["tiny"].mimi)
    codec = MimiModel(cfg)
    layer = codec.quantizer.semantic_residual_vector_quantizer.layers[0].codebook
    assert not layer.embed.any()  # as transformers builds it: every code the same vector
    torch.manual_seed(0)
    assert seed_codebooks(codec) == cfg.num_quantizers
    assert layer.embed.std() > 0.5
    assert len(set(map(tuple, layer.embed.tolist()))) == cfg.codebook_size  # all distinct
    with pytest.raises(RuntimeError, match="no EuclideanCodebook"):
        seed_codebooks(torch.nn.Linear(2, 2))


# ------------------------------------------------------------ a real run of the tiny model


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> ResultRecord:
    """stock and audio_head on the tiny model, 2 prompts x 2 seeds; fidelity fails for
    audio_head alone (injected), as a technique's broken comparison would, and its audio is
    one fixed clip whatever the input (injected), as a stack serving cached audio would."""
    from orchestrate.api.config import load_model_spec
    from orchestrate.api.protocol import load_protocol
    from orchestrate.families.rumik.family import RumikFamily
    from orchestrate.running import worker
    from orchestrate.running.plan import plan_job

    real, real_synthesize = RumikFamily.fidelity, RumikFamily.synthesize
    clip = np.random.default_rng(7).standard_normal(200_000).astype(np.float32)

    def fidelity(self, model, engines, workload, steps):
        if "fast" in engines:
            raise RuntimeError("injected: this stack's comparison broke")
        return real(self, model, engines, workload, steps)

    def synthesize(self, engine, text, seed, workload):
        syn = real_synthesize(self, engine, text, seed, workload)
        if type(engine.head).__name__ == "AudioRowsHead":  # audio_head's engine: "fast"
            syn.audio = clip[: syn.audio.size].copy()
        return syn

    wl = Workload(
        name="guards", prompts=[Prompt(id="a", text="A first one."), Prompt(id="b", text="Two.")],
        seeds=[1, 2], warmups=1, length_policy=LengthPolicy(mode="fixed", frames=2),
        save_audio=0, measure_ttfa=False,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("run")
    job = plan_job(
        load_model_spec("tiny"), wl, [STOCK, FAST], load_protocol(), out, fidelity_steps=8
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RumikFamily, "fidelity", fidelity)
        mp.setattr(RumikFamily, "synthesize", synthesize)
        result = worker.run_job(job)
    result.write(Path(out) / "result.json")
    return result


def test_input_blind_audio_is_flagged_and_the_tiny_models_audio_is_not(tiny_run):
    """The random-weight model's audio depends on its prompt and seed (its codec's codebooks
    are seeded: api.family.seed_codebooks), so the guard can tell it from a stack whose
    audio does not."""
    stock, fast = tiny_run.results
    assert stock.audio_independent_of_input is None
    assert metrics.SAME_AUDIO not in stock.metrics
    same = fast.audio_independent_of_input
    assert same is not None and same.differs_in == "prompt"
    assert same.max_abs_diff == 0.0 and fast.metrics[metrics.SAME_AUDIO] == 1.0
    run = stored(tiny_run)
    stored_stock, stored_fast = run["stacks"]
    # from the stored rounds alone (no result file beside this store's run): prompt/seed
    assert any(w.startswith("fast: audio independent of input: a/seed 1 and b/seed 1")
               for w in stored_fast["warnings"]), stored_fast["warnings"]  # fmt: skip
    assert not any("independent of input" in w for w in stored_stock["warnings"])
    assert "same audio" in text(tables.stack_table("t", run["stacks"]))


def test_a_fidelity_failure_is_that_stacks_own_error(tiny_run):
    stock, fast = tiny_run.results
    assert stock.fidelity is not None and stock.fidelity_error is None
    assert fast.fidelity is None and "injected" in (fast.fidelity_error or "")
    assert (
        fast.metrics[metrics.FIDELITY_FAILED] == 1.0
        and metrics.FIDELITY_FAILED not in stock.metrics
    )
    warnings = stored(tiny_run)["stacks"][1]["warnings"]
    assert any(w.startswith("fast: fidelity failed") for w in warnings), warnings


def test_the_host_cpu_is_recorded_and_shown(tiny_run):
    env = tiny_run.environment
    assert env.cpu_model == environment.cpu_model() and env.cpu_model
    assert env.cpu_single_thread_ms and env.cpu_single_thread_ms > 0
    assert env.cpu_max_mhz == environment.cpu_max_mhz()
    line = tables.environment_line(env.model_dump())
    assert env.cpu_model in line and f"{env.cpu_count} logical cores" in line
    assert "single-thread loop" in line


# ------------------------------------------------------------------ what fidelity covered


def fidelity(not_covered: dict[str, str] | None = None) -> FidelityRecord:
    return FidelityRecord(
        steps=8, max_abs_logit_diff=0.0, mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
        topk_agreement=1.0, within_tolerance=True, tolerance=1e-3, covers=["decoder", "head"],
        not_covered=not_covered or {},
    )  # fmt: skip


def test_fidelity_that_did_not_run_a_slot_says_so():
    sampled = stack_result(FAST, 0.5)
    sampled.fidelity = fidelity({"sampler": "device_sampler"})
    covered = stack_result(StackSpec(name="head", techniques=FAST.techniques), 0.5)
    covered.fidelity = fidelity()
    bare = stack_result(StackSpec(name="bare", techniques=FAST.techniques), 0.5)
    run = stored(result_record([stack_result(STOCK, 1.0), sampled, covered, bare]))
    by = {s["name"]: s for s in run["stacks"]}
    assert by["fast"]["warnings"] == ["fast: fidelity never ran its sampler (device_sampler): "
                                      "not measured there"]  # fmt: skip
    assert tables.exact_cell(by["fast"]) == "yes (partly unmeasured)"
    assert by["head"]["warnings"] == [] and tables.exact_cell(by["head"]) == "yes"
    assert by["bare"]["warnings"] == ["bare: no fidelity recorded: exactness unmeasured"]
    assert by["stock"]["warnings"] == []  # the reference needs none


def test_the_rumik_fidelity_says_what_it_covered(tiny_run):
    stock = tiny_run.results[0].fidelity
    assert stock is not None and stock.covers and "sampler" not in stock.covers
    assert "decoder" in stock.covers and stock.not_covered == {}


# ------------------------------------------------------- a skip that hides a broken install


def test_require_or_skip_fails_where_a_package_is_required(monkeypatch):
    import conftest

    missing = "orchestrate_no_such_package"
    monkeypatch.setattr(conftest, "REQUIRE", False)
    monkeypatch.setattr(conftest, "_cuda", lambda: False)
    with pytest.raises(pytest.skip.Exception, match=missing):
        conftest.require_or_skip(missing)
    assert conftest.require_or_skip("numpy") is np
    monkeypatch.setattr(conftest, "_cuda", lambda: True)  # a GPU package on a CUDA host
    with pytest.raises(pytest.fail.Exception, match=missing):
        conftest.require_or_skip(missing, gpu=True)
    monkeypatch.setattr(conftest, "REQUIRE", True)  # CI: ORCHESTRATE_REQUIRE_QUALITY=1
    with pytest.raises(pytest.fail.Exception, match="required here"):
        conftest.require_or_skip(missing)
