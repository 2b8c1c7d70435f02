"""Ledger, frontier and figures from recorded results; the protocol commands end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrate.api import protocol as proto
from orchestrate.api.config import CONFIG_DIR, ModelSpec, Prompt, StackSpec, TechniqueRef, Workload
from orchestrate.api.protocol import Gate, Protocol, QualitySpec, load_protocol
from orchestrate.api.records import (
    EnvironmentInfo,
    FidelityRecord,
    JobSpec,
    ResultRecord,
    StackResult,
    UtteranceRecord,
)
from orchestrate.reports import figures, ledger
from orchestrate.reports.frontier import collect
from orchestrate.research import decide, holdout
from orchestrate.research.scoring_run import (
    ScoreRow,
    ScoreSheet,
    load_rows,
    stack_quality,
    store_sheet,
)
from orchestrate.running.metrics import summarize
from orchestrate.running.runner import comparisons
from orchestrate.store.store import Store

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)
PROTOCOL = Protocol(
    version=2,
    quality=QualitySpec(
        gates=[Gate(metric="wer", max_delta=0.02), Gate(metric="mos", min_delta=-0.1)]
    ),
)
# Trained weights (a local checkpoint): quality scores mean something, so gates judge them.
# The tiny preset's random weights would make every quality line "not meaningful"
# (tests/test_champion_honesty.py).
REAL = ModelSpec(preset="tiny", weights="ckpt/tiny")
SCORERS = {
    "asr": "whisper_tiny_en",
    "mos": "dnsmos",
    "sim": "resemblyzer",
    "integrity": "integrity",
}


def spec(name: str, exact: bool = True) -> StackSpec:
    techniques = [TechniqueRef(name="static_kv_cache")]
    if not exact:
        techniques.append(TechniqueRef(name="codebook_head"))
    return StackSpec(name=name, techniques=techniques)


def fidelity(ok: bool) -> FidelityRecord:
    return FidelityRecord(
        steps=32, max_abs_logit_diff=0.0 if ok else 3.0, mean_kl=0.0 if ok else 0.2,
        max_kl=0.0 if ok else 0.9, top1_agreement=1.0 if ok else 0.7, topk_agreement=1.0,
        within_tolerance=ok, tolerance=1e-3,
    )  # fmt: skip


def stack_result(
    s: StackSpec, speedup: float, exact: bool = True, fid_ok: bool = True, status: str = "ok"
) -> StackResult:
    if status == "failed":
        return StackResult(stack=s, status="failed", error="OOM: CUDA out of memory (40 GiB)")
    utts = [
        UtteranceRecord(
            prompt_id=f"p{i}", seed=42, round=i, latency_s=(0.5 + 0.1 * i) / speedup,
            lm_s=0.4 / speedup, codec_s=0.1, prompt_tokens=20, new_tokens=640, frames=80,
            audio_s=6.4, stop_reason="length_policy", audio_path=f"{s.name}/p{i}.wav",
        )
        for i in range(4)
    ]  # fmt: skip
    return StackResult(
        stack=s, status="ok", exact=exact, utterances=utts, metrics=summarize(utts),
        fidelity=None if not s.techniques else fidelity(fid_ok),
    )  # fmt: skip


def record(
    store: Store, minutes: int, stacks: list[StackResult], workload: str = "smoke",
    protocol: Protocol = PROTOCOL, model: ModelSpec = REAL,
) -> tuple[str, ResultRecord]:  # fmt: skip
    results = [stack_result(StackSpec(name="stock"), 1.0), *stacks]
    job = JobSpec(
        model=model, protocol=protocol, output_dir="out",
        workload=Workload(name=workload, prompts=[Prompt(id=f"p{i}", text="x") for i in range(4)]),
        stacks=[r.stack for r in results],
    )  # fmt: skip
    t = T0 + timedelta(minutes=minutes)
    result = ResultRecord(
        job=job, status="finished", started_at=t, finished_at=t + timedelta(seconds=30),
        environment=EnvironmentInfo(
            hostname="gpu1", platform="Linux", python="3.11", torch="2.9", transformers="5.0",
            device_name="NVIDIA H200", gpu_count=1, cpu_count=16, model_config_hash="abc",
        ),
        results=results,
    )  # fmt: skip
    return store.ingest(result, comparisons(result)), result


def scores(store: Store, run_id: str, result: ResultRecord, wer: dict[str, float]) -> None:
    """Store realistic per-utterance scores: `wer` per stack, MOS ~3.9, SIM ~0.85."""
    rows = []
    for sr in result.results:
        for i, u in enumerate(sr.utterances):
            words = 20
            values = {
                "asr": {"wer": wer[sr.stack.name], "cer": wer[sr.stack.name] / 2,
                        "word_errors": round(wer[sr.stack.name] * words), "ref_words": words,
                        "char_errors": 1, "ref_chars": 100},
                "mos": {"mos": 3.9 - i / 100, "sig_mos": 4.0, "bak_mos": 4.1, "p808_mos": 3.8},
                "sim": {"sim": 0.85 + i / 100},
                "integrity": {"clipped_samples": 0, "clipped_fraction": 0.0,
                              "nonfinite_samples": 0, "rms_dbfs": -20.0, "silent": 0.0,
                              "duration_s": 6.4},
            }  # fmt: skip
            for kind, name in SCORERS.items():
                rows.append(
                    ScoreRow(
                        stack=sr.stack.name, utterance=i, prompt_id=u.prompt_id, seed=u.seed,
                        round=u.round, scorer=name, scorer_version="1", kind=kind,
                        reference=False, weights_id="sha256:test", status="ok",
                        values=values[kind],
                    )
                )  # fmt: skip
    sheet = ScoreSheet(
        job_id=result.job.job_id, protocol_hash=PROTOCOL.content_hash(), scorers=SCORERS,
        host="scorer-1", created_at=T0, rows=rows,
    )  # fmt: skip
    store_sheet(store, run_id, sheet)


def _open_holdout(store: Store, stack: StackSpec) -> holdout.Opened:
    with holdout.unseal("gate") as key:
        return holdout.open_audit(store, key, "smoke", "h", stack, PROTOCOL.content_hash())


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A research history: exact and approximate stacks, scored and not, a crash, a
    rejected stack, a holdout evaluation, a run under another protocol, and noise runs."""
    monkeypatch.setattr(holdout, "SANCTIONED_READERS", frozenset({(__name__, "_open_holdout")}))
    store = Store(f"sqlite:///{tmp_path / 'runs.db'}")
    a, b, c, d, e, f = (spec("A"), spec("B", False), spec("C"), spec("D", False),
                        spec("E", False), spec("F"))  # fmt: skip
    record(store, 0, [stack_result(a, 1.5)])
    run_b, res_b = record(store, 1, [stack_result(b, 2.0, exact=False)])
    scores(store, run_b, res_b, {"stock": 0.05, "B": 0.12})  # B breaks the WER gate
    q = stack_quality(res_b, load_rows(store, run_b), PROTOCOL)
    verdict = decide.judge(
        res_b.results[1], [], decide.check_gates(q["stock"], q["B"], PROTOCOL.quality)
    )
    decide.record(
        store, run_id=run_b, stack=b, verdict=verdict, protocol=PROTOCOL, family="rumik",
        model="ckpt/tiny:float32", workload="smoke", hardware="NVIDIA H200", speedup=2.0,
        evidence={},
    )  # fmt: skip
    record(store, 2, [stack_result(c, 1.8), stack_result(spec("G"), 1.0, status="failed")])
    record(store, 3, [stack_result(d, 2.5, exact=False)])
    run_e, res_e = record(store, 4, [stack_result(e, 1.6, exact=False)])
    scores(store, run_e, res_e, {"stock": 0.05, "E": 0.055})
    record(store, 5, [stack_result(f, 2.2, fid_ok=False)])  # an "exact" stack that is not
    record(store, 6, [stack_result(spec("Z"), 3.0)], protocol=Protocol(version=1))
    record(store, 7, [stack_result(spec("stock.aa"), 1.01)], workload="smoke@noise")
    run_h, res_h = record(store, 8, [stack_result(e, 1.55, exact=False)], "smoke@holdout")
    scores(store, run_h, res_h, {"stock": 0.06, "E": 0.07})
    opened = _open_holdout(store, e)
    holdout.close_audit(store, opened.audit_id, "accept", run_h, {"verdict": "accept"})
    yield store
    store.close()


def test_frontier_counts_only_unflagged_points(history: Store) -> None:
    data = collect(history, PROTOCOL, "smoke")
    by_stack = {p.stack: p for p in data.points}
    assert [p.stack for p in data.points] == ["A", "B", "C", "D", "E", "F", "E"]
    assert by_stack["A"].status == "pass" and by_stack["C"].status == "pass"
    assert by_stack["B"].status == "alert" and by_stack["B"].gate == "retained"
    assert any(r.startswith("wer: ") for r in by_stack["B"].reasons)
    assert any("retained by the gate: gate: wer" in r for r in by_stack["B"].reasons)
    assert by_stack["D"].status == "unverified"
    assert by_stack["F"].status == "alert" and "fidelity" in by_stack["F"].reasons[0]
    assert data.points[-1].phase == "holdout"
    assert {p.gate for p in data.points if p.stack != "B"} == {"not gated"}
    # nothing accepted by a gate: no gated frontier; apart, the best of never-gated stacks:
    # A 1.5x, then C 1.8x; B (2.0x), D (2.5x), F (2.2x) never count
    assert data.frontier == []
    assert [(s["stack"], round(s["speedup"], 3), s["label"]) for s in data.dev_only] == [
        ("A", 1.5, "dev only, not gated"),
        ("C", 1.8, "dev only, not gated"),
    ]
    assert data.excluded == {"protocol " + Protocol(version=1).content_hash() + " (v1)": 1}
    assert data.hardware == "NVIDIA H200" and data.model == "ckpt/tiny:float32"
    # speed vs WER: stock, E (1.55x, +0.01 on holdout) and B (2.0x, +0.07) trade off
    assert data.pareto_metric == "wer"
    assert [c["stack"] for c in data.pareto] == ["stock", "E", "B"]


def test_frontier_of_another_protocol_version_is_separate(history: Store) -> None:
    data = collect(history, Protocol(version=1), "smoke")
    assert [p.stack for p in data.points] == ["Z"]
    assert sum(data.excluded.values()) == 7  # every v2 run, named by its protocol


def test_ledger_lists_every_rejection_with_its_cause(history: Store, tmp_path: Path) -> None:
    rows = ledger.entries(history)
    causes = {(r["stack_name"], r["cause"]) for r in rows}
    assert {("G", "oom"), ("B", "gate")} <= causes
    (gate,) = ledger.entries(history, cause="gate")
    assert gate["stack_name"] == "B" and "wer" in gate["detail"]
    assert gate["workload"] == "smoke" and gate["protocol_version"] == 2
    assert ledger.entries(history, stack="G")[0]["detail"].startswith("OOM")
    path = ledger.write(history, tmp_path / "reports" / "ledger.md")
    text = path.read_text()
    assert "| G | oom |" in text and "| B | gate |" in text
    assert "**retain**" in text and "No champion yet" in text


def test_figures_are_drawn_from_stored_records(history: Store, tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "figures"
    manifest = figures.render_all(history, PROTOCOL, "smoke", out)
    assert set(manifest["figures"]) == {
        "frontier.png", "pareto.png", "quality_screen.png", "holdout_deltas.png", "ladder.png",
    }  # fmt: skip
    for name in manifest["figures"]:
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 300
    holdout_run = manifest["figures"]["holdout_deltas.png"]["runs"]
    assert manifest["figures"]["quality_screen.png"]["runs"] == holdout_run
    evaluations = figures.holdout_evaluations(history, PROTOCOL, "smoke")
    assert evaluations[0]["deltas"]["wer"] == pytest.approx(0.01)
    assert json.loads((out / "manifest.json").read_text())["protocol"].startswith("default v2")


def test_figures_without_data_say_so(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'empty.db'}") as store:
        manifest = figures.render_all(store, PROTOCOL, "smoke", tmp_path / "f")
    assert manifest["figures"] == {}
    assert "no experiments" in manifest["skipped"]["frontier.png"]


# --------------------------------------------------------------------------- end to end

WORKLOAD = """\
name: mini
prompts:
  - {id: a, text: "A short first sentence."}
  - {id: b, text: "And a second one."}
seeds: [42]
warmups: 0
length_policy: {mode: fixed, frames: 8}
save_audio: 1
"""
HOLDOUT = """\
sealed_holdout:
  for_workload: mini
  prompts:
  - {id: h1, text: "The library closes early on Fridays."}
  - {id: h2, text: "He packed a warm coat for the trip."}
"""


def cli(args: list[str], env: dict[str, str], cwd: Path, ok: bool = True) -> Any:
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrate.cli", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if ok and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.skipif(shutil.which("git") is None, reason="plan_job records the git sha")
def test_noise_gate_ledger_frontier_figures_on_the_tiny_model(tmp_path: Path) -> None:
    (tmp_path / "wl.yaml").write_text(WORKLOAD)
    (tmp_path / "holdout.yaml").write_text(HOLDOUT)
    # the default A/A bound (noise.max_aa_cv) would refuse a busy 2-core box: not under test
    loose = (CONFIG_DIR / "protocol.yaml").read_text().replace("max_aa_cv: 0.15", "max_aa_cv: 9")
    (tmp_path / "protocol.yaml").write_text(loose)
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ORCHESTRATE_DB_URL": f"sqlite:///{tmp_path / 'runs.db'}",
    }
    common = ["--workload", "wl.yaml", "--protocol", "protocol.yaml"]

    refused = cli(["gate", "--stack", "cpu-fast", *common], env, tmp_path, ok=False)
    assert refused.returncode == 2 and "no quality gates" in refused.stderr  # noise first

    noise = ["noise", "--repeats", "2", "--no-mlflow", "--json", "--out", "protocol.yaml"]
    out = json.loads(cli([*noise, *common], env, tmp_path).stdout)  # --out: not protocols/
    assert out["protocol"]["version"] == 2 and len(out["runs"]) == 2
    assert {g["metric"] for g in out["gates"]} == {"wer", "cer", "mos", "sim"}
    assert out["min_speedup"] >= 1.0
    assert "version: 2" in (tmp_path / "protocol.yaml").read_text()

    # Timing on a shared 2-core box must not pick the verdict: a new protocol version whose
    # speed bar no CPU run clears makes it exactly one (accept is tested on fixed records:
    # test_champion_honesty.py).
    noise_v2 = load_protocol(str(tmp_path / "protocol.yaml"))
    bar = noise_v2.speed.model_copy(update={"min_speedup": 1000.0})
    v3 = noise_v2.model_copy(update={"version": 3, "speed": bar})
    proto.write(v3, tmp_path / "protocol.yaml")
    gated = cli(["gate", "--stack", "cpu-fast", "--holdout", "holdout.yaml", "--json", *common],
                env, tmp_path, ok=False)  # fmt: skip
    assert gated.stdout.strip(), gated.stderr  # a report, not an error
    report = json.loads(gated.stdout)
    verdict = report["verdict"]
    assert verdict["verdict"] == "retain" and gated.returncode == 3  # the documented code
    assert report["holdout_run"] is None and "holdout_flags" not in report  # stayed sealed
    # faster than stock (under the bar) or not, and noisy or not (`slower`): measured facts
    causes = set(verdict["causes"])
    assert causes and causes <= {"below the noise bar", "slower"} and verdict["failure"] is None
    # the tiny model's weights are random: quality is not judged, and the verdict says so
    assert report["random_weights"] and verdict["quality"] == "not meaningful: random weights"
    assert report["record"]["headline"]["label"] == "remeasure paired"
    with Store(env["ORCHESTRATE_DB_URL"]) as store:
        assert holdout.list_audits(store) == [] and decide.list_champions(store) == []
        entries = ledger.entries(store, stack="cpu-fast")
        assert {e["cause"] for e in entries} == causes
        assert {e["stored_cause"] for e in entries} == {"slower"}  # the column's closed set
        (decision,) = decide.list_decisions(store)
        assert (decision["stack"], decision["verdict"]) == ("cpu-fast", "retain")

    # a scoring worker without the database, then its sheet ingested here
    result_json = next((tmp_path / "runs").glob("*/result.json"))
    cli(["score", "--result", str(result_json), "--out", "sheet.json", *common[2:]], env,
        tmp_path)  # fmt: skip
    sheet = json.loads((tmp_path / "sheet.json").read_text())
    assert {r["scorer"] for r in sheet["rows"]} == set(SCORERS.values())
    cli(["score", "--ingest", "sheet.json", "--json", *common[2:]], env, tmp_path)

    rows = json.loads(cli(["ledger", "--json", "--out", "ledger.md"], env, tmp_path).stdout)
    assert (tmp_path / "ledger.md").read_text().startswith("# Failure ledger")
    assert isinstance(rows, list)
    front = json.loads(cli(["frontier", "--json", *common], env, tmp_path).stdout)
    assert "cpu-fast" in {p["stack"] for p in front["points"]}
    manifest = json.loads(
        cli(["figures", "--out", "figs", "--json", *common], env, tmp_path).stdout
    )
    assert "frontier.png" in manifest["figures"] and (tmp_path / "figs" / "frontier.png").is_file()

    sealed = cli(["run", "--stack", "cpu-fast", "--workload", "holdout.yaml", "--no-mlflow"],
                 env, tmp_path, ok=False)  # fmt: skip
    assert sealed.returncode == 2 and "sealed_holdout" in sealed.stderr


def test_ladder_and_throughput_figures_from_stored_records(tmp_path, make_result_record):
    from orchestrate.api.config import TechniqueRef
    from orchestrate.reports.figures import render_all
    from orchestrate.reports.ladder import ladder, throughput
    from orchestrate.running.runner import comparisons
    from orchestrate.store.store import Store

    result = make_result_record(job_id="ladder01")
    stock, fast = result.results

    def batched(size: int, latency_scale: float):
        spec = fast.stack.model_copy(
            update={
                "name": f"fast-b{size}",
                "techniques": [
                    *fast.stack.techniques,
                    TechniqueRef(name="batch", params={"size": size}),
                ],
            }
        )
        metrics = fast.metrics | {
            "median_latency_s": fast.metrics["median_latency_s"] * latency_scale
        }
        return fast.model_copy(update={"stack": spec, "metrics": metrics})

    b = stock.model_copy(
        update={"stack": stock.stack.model_copy(update={"name": "b", "baseline": True})}
    )
    result = result.model_copy(update={"results": [stock, b, fast, batched(4, 2.0)]})
    rungs = {r.stack: r for r in ladder(result)}
    assert rungs["fast"].metric == "rtf" and rungs["fast"].speedups["stock"] == pytest.approx(2.0)
    assert rungs["fast"].speedups["b"] == pytest.approx(2.0)  # b is stock's twin
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        store.ingest(result, comparisons(result))
        data = throughput(store, "smoke")
        path = next(p for p in data if "batch" not in p and p != "stock")
        # batch 4 at twice the latency: twice the utterances per second of batch 1
        assert data[path][4] == pytest.approx(2 * data[path][1])
        manifest = render_all(store, Protocol(), "smoke", tmp_path / "fig")
    assert (tmp_path / "fig" / "ladder.png").stat().st_size > 0
    assert (tmp_path / "fig" / "throughput.png").stat().st_size > 0
    assert manifest["figures"]["ladder.png"]["runs"]


def test_ladder_figure_of_a_chosen_run(tmp_path, make_result_record):
    from orchestrate.reports.figures import render_all
    from orchestrate.running.runner import comparisons
    from orchestrate.store.store import Store

    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        for job_id in ("older001", "newer002"):
            result = make_result_record(job_id=job_id)
            store.ingest(result, comparisons(result))
        ids = [r["id"] for r in store.list_runs()]
        for run_id in ids:
            manifest = render_all(store, Protocol(), "smoke", tmp_path / "fig", ladder_run=run_id)
            assert manifest["figures"]["ladder.png"]["runs"] == [run_id]
        with pytest.raises(LookupError, match="not a finished run of workload 'smoke'"):
            render_all(store, Protocol(), "smoke", tmp_path / "fig", ladder_run="nope")
