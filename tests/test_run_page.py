"""`orchestrate report RUN`: a real run of the tiny model as one page, its clips made fit to
hear (16-bit PCM, level-set, clipping flagged), and the worker's WAVs valid files."""

from __future__ import annotations

import contextlib
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from typer.testing import CliRunner

from orchestrate.api.config import LengthPolicy, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.records import ResultRecord
from orchestrate.reports.listening import PEAK_CEILING_DBFS, TARGET_RMS_DBFS, listening_clip
from orchestrate.running import audio


def _chunks(data: bytes) -> dict[bytes, bytes]:
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8  # the RIFF size is the file's
    out, at = {}, 12
    while at < len(data):
        tag, size = data[at : at + 4], struct.unpack("<I", data[at + 4 : at + 8])[0]
        out[tag] = data[at + 8 : at + 8 + size]
        at += 8 + size
    return out


def test_the_workers_float_wav_has_the_chunks_a_non_pcm_wave_needs(tmp_path: Path) -> None:
    samples = np.linspace(-2.0, 2.0, 1001, dtype=np.float32)  # beyond full scale: kept
    path = tmp_path / "a.wav"
    audio.write_wav(path, samples, 24_000)
    chunks = _chunks(path.read_bytes())
    fmt = chunks[b"fmt "]
    assert len(fmt) == 18 and struct.unpack("<HHIIHHH", fmt) == (3, 1, 24_000, 96_000, 4, 32, 0)
    assert struct.unpack("<I", chunks[b"fact"])[0] == 1001
    info = sf.info(path)
    assert (info.subtype, info.frames, info.samplerate) == ("FLOAT", 1001, 24_000)
    np.testing.assert_array_equal(sf.read(path, dtype="float32")[0], samples)


def _rms_dbfs(x: np.ndarray) -> float:
    return 20 * float(np.log10(np.sqrt(np.mean(np.square(x, dtype=np.float64)))))


def _decoded(clip_b64: str, tmp_path: Path) -> tuple[np.ndarray, sf._SoundFileInfo]:
    import base64

    path = tmp_path / "clip.wav"
    path.write_bytes(base64.b64decode(clip_b64))
    return sf.read(path, dtype="float64")[0], sf.info(path)


def test_a_loud_random_weight_clip_is_level_set_to_16_bit_and_flagged(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    loud = (37.0 * np.tanh(rng.standard_normal(24_000))).astype(np.float32)  # peaks ~37x
    audio.write_wav(tmp_path / "loud.wav", loud, 24_000)
    clip = listening_clip(tmp_path / "loud.wav")
    played, info = _decoded(clip.wav_base64, tmp_path)
    assert info.subtype == "PCM_16" and info.frames == loud.size
    peak_db = 20 * np.log10(np.abs(played).max())
    # the target RMS, unless the peak ceiling held it lower; never over the ceiling
    assert peak_db <= PEAK_CEILING_DBFS + 0.01
    assert abs(_rms_dbfs(played) - TARGET_RMS_DBFS) < 0.1 or abs(peak_db - PEAK_CEILING_DBFS) < 0.01
    assert clip.gain_db < -30  # brought down from ~37x full scale
    assert clip.clipped_samples > 0 and clip.source_peak > 30
    assert any("clipped as generated" in f for f in clip.flags)


def test_a_quiet_clip_is_raised_and_silence_and_nan_are_said(tmp_path: Path) -> None:
    t = np.arange(24_000) / 24_000
    quiet = (0.001 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    audio.write_wav(tmp_path / "quiet.wav", quiet, 24_000)
    clip = listening_clip(tmp_path / "quiet.wav")
    played, _ = _decoded(clip.wav_base64, tmp_path)
    assert abs(_rms_dbfs(played) - TARGET_RMS_DBFS) < 0.1
    assert clip.flags == [] and clip.gain_db > 30

    broken = np.zeros(4800, dtype=np.float32)
    broken[100] = np.nan
    audio.write_wav(tmp_path / "nan.wav", broken, 24_000)
    flags = listening_clip(tmp_path / "nan.wav").flags
    assert flags == ["1 non-finite samples (played as silence)", "silent"]


# ------------------------------------------------------------ a real run of the tiny model


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory):
    """stock and packed_projections on the tiny model, two prompts of different lengths,
    recordings kept, ingested into a store as `orchestrate run` does."""
    from orchestrate.api.config import load_model_spec
    from orchestrate.api.protocol import load_protocol
    from orchestrate.running import worker
    from orchestrate.running.plan import plan_job
    from orchestrate.running.runner import ingest
    from orchestrate.store.store import Store

    wl = Workload(
        name="page",
        prompts=[
            Prompt(id="short", text="Hi."),
            Prompt(id="long", text="A longer sentence for a longer clip."),
        ],
        seeds=[1],
        warmups=0,
        save_audio=2,
        length_policy=LengthPolicy(
            mode="per_char", frames_per_char=1.0, min_frames=4, max_frames=40
        ),
    )
    stacks = [
        StackSpec(name="stock"),
        StackSpec(name="cached", techniques=[TechniqueRef(name="static_kv_cache")]),
    ]
    root = tmp_path_factory.mktemp("run")
    job = plan_job(
        load_model_spec("tiny"), wl, stacks, load_protocol(), root / "job", fidelity_steps=8
    )
    result = worker.run_job(job)
    result.write(root / "job" / "result.json")
    url = f"sqlite:///{root / 'runs.db'}"
    outcome = ingest(root / "job" / "result.json", Store(url), track=False)
    return url, outcome.run_id, result


def _report(url: str, ref: str, out: Path) -> str:
    from orchestrate.cli import app

    shown = CliRunner().invoke(app, ["report", ref, "--db", url, "--out", str(out)])
    assert shown.exit_code == 0, shown.output
    return shown.output


def test_a_runs_page_holds_every_section_and_a_player_per_recording(stored_run, tmp_path) -> None:
    url, run_id, result = stored_run
    said = _report(url, run_id[:8], tmp_path / "run.html")
    assert "2 stacks, 4 clips" in said
    page = (tmp_path / "run.html").read_text()
    for section in (
        "Stacks",
        "Fidelity",
        "Quality",
        "Settings",
        "Environment",
        "Protocol",
        "Listening pack",
    ):
        assert f"<h2>{section}</h2>" in page
    assert page.count("<audio") == 4 and page.count('alt="spectrogram"') == 4
    assert "speedup (paired, 95% CI)" in page and "RTF ratio (aggregate)" in page
    assert result.environment.torch in page and "Random weights" in page
    assert "A longer sentence for a longer clip." in page  # the prompt's text beside its clips
    assert "Not scored" in page
    lengths = {u.prompt_id: u.audio_s for u in result.results[0].utterances}
    assert lengths["long"] > lengths["short"]  # clips of different lengths, as the browser sees


def test_report_names_what_it_cannot_find(stored_run) -> None:
    from orchestrate.cli import app

    url, _, _ = stored_run
    shown = CliRunner().invoke(app, ["report", "ffffffff", "--db", url])
    assert shown.exit_code == 2
    assert "no run or exploration with id 'ffffffff'" in shown.output


def test_a_holdout_runs_page_keeps_its_texts_and_clips_sealed(stored_run, tmp_path) -> None:
    from orchestrate.reports.run_page import render, view_from_store
    from orchestrate.store.store import Store

    url, run_id, result = stored_run
    store = Store(url)
    sealed = result.job.model_copy(update={"sealed_file": "/nowhere/holdout.yaml"})
    real = store.get_result

    def as_holdout(ref: str) -> ResultRecord:
        return real(ref).model_copy(update={"job": sealed})

    store.get_result = as_holdout  # type: ignore[method-assign]
    page = render(view_from_store(store, run_id), tmp_path / "h.html").read_text()
    assert "<audio" not in page and "stay sealed" in page
    assert "A longer sentence" not in page


def test_the_runs_page_plays_every_clip_in_headless_chromium(stored_run, tmp_path) -> None:
    from test_report_page import _chromium_dom

    url, run_id, _ = stored_run
    _report(url, run_id, tmp_path / "run.html")
    dom = _chromium_dom(tmp_path / "run.html", screenshot=tmp_path / "run.png")
    body = re.search(
        r'<body data-players="(\d+)" data-images="(\d+)" data-loaded="(\d+)" '
        r'data-sized="(\d+)"',
        dom,
    )
    assert body, f"the page's script did not run: {dom[:300]!r}"
    players, images, loaded, sized = map(int, body.groups())
    assert (players, loaded) == (4, 4)
    assert images == sized == 5  # the headline figure and four spectrograms
    assert (tmp_path / "run.png").stat().st_size > 10_000


def test_an_explorations_page_names_where_it_ran(tmp_path: Path) -> None:
    """The committed H200 exploration's page gives its device, host CPU, versions, date and
    commit (from its newest run, read here from its database: a resume adds newer runs),
    which the page once left out."""
    import shutil
    import sqlite3

    db = tmp_path / "explore.db"
    shutil.copy(Path(__file__).parents[1] / "benchmarks/h200/issue31-explore-stock.db", db)
    with contextlib.closing(sqlite3.connect(db)) as con:
        started, sha = con.execute(
            "SELECT started_at, code_sha FROM runs ORDER BY started_at DESC LIMIT 1"
        ).fetchone()
    _report(f"sqlite:///{db}", "59be54fef175", tmp_path / "e.html")
    page = (tmp_path / "e.html").read_text()
    env = page[page.index("<h2>Environment</h2>") : page.index("<h2>Frontier over time</h2>")]
    for shown in ("NVIDIA H200", "driver 580", "Intel(R) Xeon(R)", "torch 2.11.0", started[:10],
                  sha[:12]):  # fmt: skip
        assert shown in env


def test_an_unreadable_recording_costs_its_cell_not_the_page(stored_run, tmp_path) -> None:
    """A truncated WAV (a disk that filled, a copy cut short) is named on the page; every
    other clip still plays."""
    from orchestrate.research.scoring_run import audio_root

    url, run_id, result = stored_run
    utt = result.results[1].utterances[0]
    wav = audio_root(result) / utt.audio_path
    kept = wav.read_bytes()
    try:
        wav.write_bytes(kept[:30])  # a RIFF header cut short
        said = _report(url, run_id, tmp_path / "run.html")
    finally:
        wav.write_bytes(kept)
    page = (tmp_path / "run.html").read_text()
    assert "2 stacks, 3 clips" in said and page.count("<audio") == 3
    assert f"{wav.name}: not a readable recording" in page


def test_a_failed_runs_page_says_why_and_has_nothing_to_play(stored_run, tmp_path) -> None:
    """A run whose worker died before its result: the page gives the error, no table of
    numbers it never measured, and no listening pack."""
    from orchestrate.api.config import load_model_spec
    from orchestrate.api.protocol import load_protocol
    from orchestrate.running.plan import plan_job
    from orchestrate.store.store import Store

    url, _, result = stored_run
    job = plan_job(
        load_model_spec("tiny"), result.job.workload, result.job.stacks, load_protocol(),
        tmp_path / "job", fidelity_steps=8,
    )  # fmt: skip
    store = Store(url)
    run_id = store.begin_run(job, "failed-run-identity")
    store.fail_run(run_id, "FAILED", "worker exited with signal 9 (SIGKILL)")
    _report(url, run_id, tmp_path / "failed.html")
    page = (tmp_path / "failed.html").read_text()
    assert "run error: worker exited with signal 9 (SIGKILL)" in page
    assert "<audio" not in page and "no recorded result: nothing to listen to" in page


def test_each_clip_shows_every_scorers_figures(stored_run, tmp_path) -> None:
    """Scores of one recording from two scorers (a transcriber listed before a similarity
    scorer): the clip shows the transcript, WER and SIM together, not the last scorer's
    alone; a score that failed its coverage is not shown."""
    import sqlite3
    from datetime import UTC, datetime

    from orchestrate.store.store import Store

    url, run_id, result = stored_run
    db = tmp_path / "scored.db"
    with sqlite3.connect(url.removeprefix("sqlite:///")) as src, sqlite3.connect(db) as dst:
        src.backup(dst)  # the write-ahead log too: a file copy would miss it
    scored_url = f"sqlite:///{db}"
    stack = result.results[0].stack.name

    def row(scorer: str, status: str, values: dict, details: dict) -> dict:
        return {
            "stack": stack, "utterance": 0, "scorer": scorer, "scorer_version": "1",
            "kind": "test", "reference": False, "weights_id": "w", "status": status,
            "values": values, "details": details, "resample": None, "packages": {},
            "error": None if status == "ok" else "no speech found",
        }  # fmt: skip

    rows = [
        row("asr", "ok", {"wer": 0.25}, {"transcript": "a heard line"}),
        row("mos", "coverage_failure", {"mos": 9.0}, {}),
        row("sim", "ok", {"sim": 0.5}, {}),
    ]
    Store(scored_url).add_scores(
        run_id, result.job.job_id, rows, created_at=datetime.now(UTC),
        protocol_hash="p", host="h",
    )  # fmt: skip
    _report(scored_url, run_id, tmp_path / "scored.html")
    page = (tmp_path / "scored.html").read_text()
    assert "a heard line" in page and "wer 0.25" in page and "sim 0.5" in page
    assert "mos 9" not in page
