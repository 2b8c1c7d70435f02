"""The sealed holdout (issue 12): a plan holding a holdout text or a near copy is refused,
named and audited; the gate's holdout job carries placeholders, and no holdout text is
written in clear anywhere (job.json, result.json, the database, MLflow)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrate.api import sealed
from orchestrate.api.config import (
    CONFIG_DIR,
    ModelSpec,
    Prompt,
    Workload,
    load_stack,
    load_workload,
)
from orchestrate.api.protocol import Gate, MetricDef, Protocol, QualitySpec
from orchestrate.api.registry import get_family
from orchestrate.api.scoring import AsrScorer
from orchestrate.research import decide, holdout, scoring_run
from orchestrate.research.gate import run_gate
from orchestrate.running.plan import plan_job
from orchestrate.store.store import Store

# Texts of this file's own sealed holdout (a tmp folder stands in for configs/holdout).
H01 = "Quiet violet lanterns drifted above the harbour long after the festival had ended."
H02 = "The painter mixed a pale green shade because the client wanted calm walls."
SEALED = f"""\
sealed_holdout:
  for_workload: seal-dev
  prompts:
  - {{id: h01, text: "{H01}"}}
  - {{id: h02, text: "{H02}"}}
"""
DEV_TEXT = "The morning train was late again, so I walked along the river."
# Frames follow text length, so a clip's frame count tells a sealed text (~75 characters)
# from its placeholder (45).
DEV = Workload(
    name="seal-dev",
    prompts=[Prompt(id="d1", text=DEV_TEXT)],
    seeds=[1],
    warmups=0,
    length_policy={"mode": "per_char", "frames_per_char": 0.2, "max_frames": 64},
    save_audio=1,
    measure_ttfa=False,
)
MODEL = ModelSpec(preset="tiny")


@pytest.fixture
def sealed_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A holdout folder of this file's own, in place of configs/holdout."""
    folder = tmp_path / "sealed"
    folder.mkdir()
    (folder / "seal-dev.yaml").write_text(SEALED)
    monkeypatch.setattr(sealed, "HOLDOUT_DIR", folder)
    return folder


def _plan(text: str, tmp_path: Path, **kw: Any) -> Any:
    wl = DEV.model_copy(update={"prompts": [Prompt(id="en03", text=text)]})
    return _plan_workload(wl, tmp_path, **kw)


def _plan_workload(wl: Workload, tmp_path: Path, **kw: Any) -> Any:
    stock = load_stack(get_family(MODEL.family).baseline)
    return plan_job(MODEL, wl, [stock], Protocol(), tmp_path, check_device=False, **kw)


# ------------------------------------------------------------------------ plan time


@pytest.mark.parametrize(
    ("text", "how"),
    [
        (H02, "exact copy"),
        ("the PAINTER mixed a pale-green shade -- because the client wanted calm walls!!", "exact"),
        (H02 + " It took three coats.", "contains the holdout text"),
        ("Because the client wanted calm walls.", "part of the holdout text"),
        (H02.replace("green", "blue"), "near copy (word ratio 0.92)"),
    ],
)
def test_a_holdout_text_or_near_copy_is_refused_by_name(
    sealed_dir: Path, tmp_path: Path, text: str, how: str
) -> None:
    with pytest.raises(sealed.HoldoutLeak) as caught:
        _plan(text, tmp_path)
    message = str(caught.value)
    assert "workload seal-dev prompt en03 matches holdout prompt h02" in message
    assert how in message and "\n" not in message
    assert H02 not in message  # the error names ids, never the sealed text
    assert [(leak.prompt_id, leak.holdout_id) for leak in caught.value.leaks] == [("en03", "h02")]


@pytest.mark.parametrize(
    "text",
    [
        "The morning train was late again.",
        "A pale green.",  # three words of h02: a phrase, shorter than MIN_CONTAINED_WORDS
        "The baker mixed a dark rye dough because the guests wanted fresh bread.",
    ],
)
def test_an_unrelated_prompt_is_planned(sealed_dir: Path, tmp_path: Path, text: str) -> None:
    job = _plan(text, tmp_path)
    assert job.workload.prompts[0].text == text and job.sealed_file is None


def test_a_placeholder_runs_only_with_its_unchanged_sealed_file(
    sealed_dir: Path, tmp_path: Path
) -> None:
    path = sealed_dir / "seal-dev.yaml"
    held = sealed.seal(
        DEV.model_copy(update={"prompts": [Prompt(id="h01", text=H01), Prompt(id="h02", text=H02)]})
    )
    with pytest.raises(sealed.SealedError, match="h01, h02 are sealed holdout placeholders"):
        _plan_workload(held, tmp_path)
    job = _plan_workload(held, tmp_path, sealed_file=path)
    assert H01 not in job.model_dump_json() and job.sealed_file == str(path.resolve())
    resolved = sealed.resolve(job.workload, job.sealed_file)
    assert [p.text for p in resolved.prompts] == [H01, H02]
    path.write_text(SEALED.replace("calm walls", "calm ceilings"))  # edited after planning
    with pytest.raises(sealed.SealedError, match="h02 is not the text this job was planned"):
        sealed.resolve(job.workload, job.sealed_file)


def test_the_committed_workloads_copy_no_holdout_prompt() -> None:
    prints = sealed.holdout_fingerprints()
    assert prints and all(len(p.digest) == 16 for p in prints)
    for path in sorted((CONFIG_DIR / "workloads").glob("*.yaml")):
        assert sealed.find_leaks(load_workload(str(path)), prints) == [], path.name


# ------------------------------------------------------------------- CLI and audit


def test_a_refused_run_exits_2_and_is_audited(tmp_path: Path) -> None:
    """Through the CLI, against the committed holdout of `smoke`."""
    ho02 = next(p for p in sealed.read_sealed(sealed.HOLDOUT_DIR / "smoke.yaml").prompts
                if p.id == "ho02")  # fmt: skip
    (tmp_path / "leaky.yaml").write_text(
        "name: leaky\nprompts:\n"
        "  - {id: en01, text: 'Nothing to see here at all.'}\n"
        f"  - {{id: en03, text: '{ho02.text.upper()}'}}\n"
        "seeds: [1]\nwarmups: 0\nlength_policy: {mode: fixed, frames: 4}\n"
    )
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    env = {**os.environ, "ORCHESTRATE_DB_URL": db}
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", "run", "--stack", "cpu-fast",
         "--workload", "leaky.yaml", "--no-mlflow"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "workload leaky prompt en03 matches holdout prompt ho02" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback
    with Store(db) as store:
        audits = holdout.list_audits(store, "leaky")
        assert not store.list_runs()  # refused before any worker
    assert len(audits) == 1
    row = audits[0]
    assert row["status"] == "error" and row["run_id"] is None and not row["flagged"]
    assert (
        row["detail"]["outcome"]
        == "refused: workload leaky prompt en03 matches holdout prompt ho02"
    )
    assert row["detail"]["holder"] == "orchestrate run" and row["stack_name"] == "cpu-fast"


# ------------------------------------------------------------ no clear text anywhere


def _opens_the_holdout(real: Any) -> Any:
    """decide.judge, but the dev remeasure's verdict (judged without gates) never retains:
    whether the candidate is faster on a shared 2-core box must not decide this test."""

    def judge(candidate: Any, speed: Any = (), gates: Any = (), *args: Any, **kw: Any) -> Any:
        if not gates:
            return decide.Verdict("accept", ["test: open the holdout"])
        return real(candidate, speed, gates, *args, **kw)

    return judge


class _EchoAsr(AsrScorer):
    """Hears nothing, so its ref_words count the reference text it was given."""

    name, version, requires = "echo", "1", ()

    def _load(self) -> list[Path]:
        return []

    def transcribe(self, audio: Any) -> str:
        return ""


def _clear_text(root: Path, skip: Path) -> str:
    """Every file under `root` but `skip` as text; SQLite files dumped (a page boundary
    could split a string in the raw bytes)."""
    parts = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and skip not in p.parents):
        if path.suffix == ".db":
            with sqlite3.connect(path) as con:
                parts.append("\n".join(con.iterdump()))
        else:
            parts.append(path.read_bytes().decode("utf-8", errors="ignore"))
    return "\n".join(parts)


@pytest.mark.slow
def test_a_gate_writes_no_holdout_text_in_clear(
    sealed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts land under the cwd
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setattr(decide, "judge", _opens_the_holdout(decide.judge))
    quality = QualitySpec(
        scorers={"asr": "whisper_tiny_en", "integrity": "integrity"},
        metrics={
            "wer": MetricDef(source="asr", value="wer", better="lower"),
            "clipped": MetricDef(source="integrity", value="clipped_fraction", better="lower"),
        },
        gates=[Gate(metric="wer", max_delta=1.0)],
        noise_gated=["wer"],
    )
    protocol = Protocol(name="seal-test", quality=quality)
    common = {
        "candidate": load_stack("cpu-fast"),
        "model": MODEL,
        "protocol": protocol,
        "runs_dir": tmp_path / "runs",
        "holdout_file": sealed_dir / "seal-dev.yaml",
    }
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        # A dev workload holding h02 is refused at plan time; its audit row is no opening.
        leaky = DEV.model_copy(update={"prompts": [Prompt(id="en03", text=H02 + " Twice.")]})
        with pytest.raises(sealed.HoldoutLeak) as caught:
            run_gate(store, dev=leaky, track=False, **common)
        holdout.audit_refusal(store, caught.value, "test")

        report = run_gate(store, dev=DEV, track=True, **common)
        assert report["holdout_run"] and report["holdout_flags"] == []
        result = store.get_result(report["holdout_run"])
        # The worker synthesised the sealed texts, not their placeholders.
        frames = {u.prompt_id: u.frames for r in result.results for u in r.utterances}
        assert frames == {"h01": round(len(H01) * 0.2), "h02": round(len(H02) * 0.2)}
        # And the scorers compared with the sealed texts.
        sheet = scoring_run.score_result(result, protocol, Path(result.job.output_dir),
                                         scorers=[_EchoAsr()])  # fmt: skip
        heard = {r.prompt_id: r.values["ref_words"] for r in sheet.rows}
        assert heard == {"h01": len(H01.split()), "h02": len(H02.split())}
        refusal, opening = holdout.list_audits(store, "seal-dev")
        assert refusal["status"] == "error" and refusal["detail"]["outcome"] == (
            "refused: workload seal-dev@remeasure prompt en03 matches holdout prompt h02"
        )
        assert opening["status"] == report["verdict"]["verdict"] and not opening["flagged"]

    # Every place a workload is written: job.json, result.json, runs.db, MLflow's database
    # and its artifact store (result.json logged again).
    assert len(list((tmp_path / "runs").glob("*/result.json"))) == 2
    assert (tmp_path / "mlflow.db").is_file() and list(tmp_path.glob("mlruns/**/result.json"))
    everything = _clear_text(tmp_path, skip=sealed_dir)
    assert DEV_TEXT in everything  # the search itself finds a prompt written in clear
    for text in (H01, H02):
        assert text not in everything and text[:30] not in everything


def test_a_holdout_transcript_is_stored_hashed(tmp_path: Path) -> None:
    """With real weights the ASR transcript of a holdout clip is the holdout text: the
    score row keeps its hash only, while a dev clip's transcript stays readable."""
    import numpy as np
    import soundfile as sf

    from orchestrate.api.records import UtteranceRecord
    from orchestrate.api.scoring import Score
    from orchestrate.research import scoring_run

    class Parrot:  # an ASR that hears exactly the prompt
        name, version, kind, reference, needs_reference_audio = "parrot", "1", "asr", False, False

        def weights_id(self) -> str:
            return "none"

        def packages(self) -> dict[str, str]:
            return {}

        def score_record(self, audio, sr, text, ref, reference_sample_rate=None):
            heard = {"transcript": text}
            return Score("parrot", "1", "asr", False, "none", {"wer": 0.0}, details=heard)

    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(1600), 16_000)
    utt = UtteranceRecord.model_validate(
        {"prompt_id": "h01", "seed": 1, "round": 0, "audio_path": "a.wav", "latency_s": 1.0,
         "lm_s": 0.9, "codec_s": 0.1, "prompt_tokens": 4, "new_tokens": 8, "frames": 1,
         "audio_s": 1.0, "stop_reason": "length_policy"}
    )  # fmt: skip
    rows = {
        sealed: scoring_run._score_one(
            Parrot(), scoring_run._Item("s", 0, utt, H01, wav, sealed=sealed), {}
        )
        for sealed in (True, False)
    }
    assert rows[False].details["transcript"] == H01
    assert H01 not in rows[True].model_dump_json()
    assert rows[True].details["transcript"].startswith("<sealed sha256:")
