"""Issue 12: a champion is shown at its holdout paired estimate, overrides are named, the
frontier is built from gate decisions, ledger causes are facts, quality on random weights is
never "ok", and MLflow carries the decisions. From record factories: no model runs."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from factories import result_record, stack_result
from typer.testing import CliRunner

from orchestrate.api import protocol as proto
from orchestrate.api.config import ModelSpec, StackSpec, TechniqueRef
from orchestrate.api.protocol import Protocol, SpeedRule
from orchestrate.api.records import FidelityRecord, StackResult
from orchestrate.reports import figures, ledger
from orchestrate.reports.frontier import collect
from orchestrate.reports.tables import headline_cell
from orchestrate.research import decide
from orchestrate.research.scoring_run import StackQuality
from orchestrate.running.runner import comparisons
from orchestrate.store.rows import classify_failure
from orchestrate.store.store import Store

T0 = datetime(2026, 5, 1, 8, 0, tzinfo=UTC)
STOCK = StackSpec(name="stock")
RANDOM = ModelSpec(preset="tiny")  # no weights: the preset's shape, random init
REAL = ModelSpec(preset="tiny", weights="ckpt/tiny")  # trained weights from a local folder
NM = decide.NOT_MEANINGFUL
FLAG = "K was re-tuned after this holdout was opened"
PROTOCOL = Protocol()
COMMON: dict[str, Any] = dict(
    protocol=PROTOCOL, family="rumik", model="tiny:float32", workload="smoke", hardware="Test CPU"
)
FID_OK = FidelityRecord(
    steps=32, max_abs_logit_diff=0.0, mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
    topk_agreement=1.0, within_tolerance=True, tolerance=1e-3,
)  # fmt: skip


def stack(name: str) -> StackSpec:
    return StackSpec(name=name, techniques=[TechniqueRef(name="static_kv_cache")])


K, R, N = stack("K"), stack("R"), stack("N")


def measured(spec: StackSpec, speedup: float, seed: int) -> StackResult:
    """A stack timed against stock's utterances (same keys), 3% jitter: a paired CI."""
    sr = stack_result(spec, 1 / speedup, jitter=0.03, seed=seed)
    return sr.model_copy(update={"fidelity": FID_OK}) if spec.techniques else sr


def run(
    store: Store, phase: str, stacks: list[StackResult], minute: int, model: ModelSpec = RANDOM
) -> str:
    """Record a run of stock + `stacks` on workload smoke (phase dev, remeasure, holdout)."""
    rec = result_record([measured(STOCK, 1.0, 0), *stacks], T0 + timedelta(minutes=minute))
    name = "smoke" if phase == "dev" else proto.phase_workload("smoke", phase)
    workload = rec.job.workload.model_copy(update={"name": name})
    job = rec.job.model_copy(update={"workload": workload, "model": model})
    rec = rec.model_copy(update={"job": job})
    return store.ingest(rec, comparisons(rec))


def headline(store: Store, run_id: str, name: str) -> dict[str, float]:
    (st,) = [s for s in store.get_run(run_id, utterances=False)["stacks"] if s["name"] == name]
    return st["metrics"]


def ok_speed(phase: str = "holdout") -> decide.SpeedCheck:
    return decide.SpeedCheck(phase, "stock", 8, 1.6, 1.5, 1.7, 0.95, 1.0, "point", True)


def gate(passed: bool = True) -> decide.GateCheck:
    delta = 0.01 if passed else 0.2
    return decide.GateCheck("wer", "Δ ≤ +0.02", 0.05, 0.05 + delta, delta, passed, f"Δ {delta:+}")


def record(
    store: Store, run_id: str, verdict: decide.Verdict, spec: StackSpec = K, speedup: float = 1.0
) -> dict[str, Any]:
    """decide.record as the gate calls it; `speedup` is what the gate passes (remeasure)."""
    return decide.record(
        store, run_id=run_id, stack=spec, verdict=verdict, speedup=speedup, evidence={}, **COMMON
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as s:
        yield s


def accept_k(store: Store, minute: int = 2) -> tuple[str, str, dict[str, Any]]:
    """K: 3.76x on a contended remeasure, 1.66x on the holdout, accepted over a holdout
    flag with --allow-holdout-reuse. Returns (remeasure run, holdout run, record's out)."""
    remeasure = run(store, "remeasure", [measured(K, 3.76, 1)], minute)
    held = run(store, "holdout", [measured(K, 1.66, 2)], minute + 1)
    verdict = decide.judge(measured(K, 1.66, 2), [ok_speed()], [gate()], [FLAG], allow_flagged=True)
    rem = headline(store, remeasure, "K")
    out = decide.record(
        store, run_id=held, stack=K, verdict=verdict, speedup=rem["speedup_paired"],
        evidence={"remeasure_run": remeasure, "holdout_run": held, "headline": rem}, **COMMON,
    )  # fmt: skip
    return remeasure, held, out


# ------------------------------------------------------------ 1. the honest champion


def test_a_champion_is_shown_at_its_holdout_paired_estimate(store: Store) -> None:
    from orchestrate.cli.common import console
    from orchestrate.cli.protocol import _gate_summary

    remeasure, held, out = accept_k(store)
    rem, hold = headline(store, remeasure, "K"), headline(store, held, "K")
    assert rem["speedup_paired"] == pytest.approx(3.76, rel=0.05)
    assert hold["speedup_paired"] == pytest.approx(1.66, rel=0.05)
    held_cell, rem_cell = headline_cell(hold), headline_cell(rem)

    assert out["headline"]["label"] == "holdout paired"
    assert out["headline"]["speedup_paired"] == hold["speedup_paired"]
    (champ,) = decide.list_champions(store)
    assert champ["speedup"] == hold["speedup_paired"]  # not the remeasure's 3.76x
    (decision,) = decide.list_decisions(store)
    assert decision["reasons"]["overridden"] == [f"{FLAG} (--allow-holdout-reuse)"]

    text = ledger.render(ledger.entries(store), ledger.decision_rows(store), [champ])
    decisions_part, champions_part = text.split("## Champions")
    assert f"{held_cell} (holdout paired)" in champions_part and rem_cell not in text
    assert FLAG in champions_part  # the overridden column
    assert "every gate held" not in text and f"overridden: {FLAG}" in decisions_part
    (row,) = ledger.champion_rows(store)
    assert row["headline"] == f"{held_cell} (holdout paired)" and FLAG in row["overridden"][0]

    report = {
        "candidate": "K", "against": "stock", "workload": "smoke", "hardware": "Test CPU",
        "protocol": "default v1", "headline": rem, "record": out,
    }  # fmt: skip
    v = decision["reasons"]
    with console.capture() as captured:
        _gate_summary(report, v, 0.95)
    shown = captured.get()
    assert f"holdout paired (the champion's headline): {held_cell}" in shown
    assert f"remeasure paired: {rem_cell}" in shown  # beside it, labelled
    assert f"overridden: {FLAG}" in shown


def test_a_decision_recorded_before_is_read_at_its_holdout_estimate(store: Store) -> None:
    """A champion stored as on main (its row's speedup the remeasure's, reasons without the
    decision headline or the overrides): the ledger still shows the holdout's number and
    names the flag that was overridden."""
    remeasure = run(store, "remeasure", [measured(K, 3.76, 1)], 0)
    held = run(store, "holdout", [measured(K, 1.66, 2)], 1)
    old = {"verdict": "accept", "reasons": [], "causes": {}, "flags": [FLAG],
           "headline": headline(store, remeasure, "K")}  # fmt: skip
    store.record_decision(
        run_id=held, stack=K, verdict="accept", reasons=old, protocol_hash="p", family="rumik",
        model="tiny:float32", workload="smoke", hardware="Test CPU", speedup=6.34,
    )  # fmt: skip
    (row,) = ledger.champion_rows(store)
    assert row["speedup"] == 6.34  # the stored column, unchanged...
    assert row["headline"] == f"{headline_cell(headline(store, held, 'K'))} (holdout paired)"
    assert row["overridden"] == [FLAG]
    (d,) = ledger.decision_rows(store)
    assert "every gate held" not in d["view"]["why"] and FLAG in d["view"]["why"]


# ------------------------------------------------------- 2. frontier from gate decisions


def test_the_frontier_is_built_from_gate_decisions(store: Store, tmp_path: Path) -> None:
    # dev: R looks best (1.839x), N is never gated
    run(store, "dev", [measured(R, 1.839, 3), measured(N, 1.5, 4)], 0)
    run(store, "remeasure", [measured(R, 1.8, 5)], 1)
    held_r = run(store, "holdout", [measured(R, 0.918, 6)], 2)
    slow = decide.speed_check(
        "holdout", measured(STOCK, 1.0, 0), measured(R, 0.918, 6), SpeedRule(),
        judge_on="point", threshold=1.0,
    )  # fmt: skip
    retain = decide.judge(measured(R, 0.918, 6), [slow], [gate()])
    assert set(retain.causes) == {"slower"}
    record(store, held_r, retain, R)
    _, held_k, _ = accept_k(store, minute=3)

    data = collect(store, PROTOCOL, "smoke")
    k_held = headline(store, held_k, "K")
    (best,) = data.frontier
    assert (best["stack"], best["label"]) == ("K", "holdout paired")
    assert best["speedup"] == k_held["speedup_paired"] and best["ci_low"] is not None
    assert best["overridden"] == [f"{FLAG} (--allow-holdout-reuse)"]
    r_points = [p for p in data.points if p.stack == "R"]
    assert len(r_points) == 3 and all(p.gate == "retained" for p in r_points)
    assert all(p.status == "alert" for p in r_points)  # 1.839x on dev, never the best
    assert any("retained by the gate: slower" in r for r in r_points[0].reasons)
    assert [(s["stack"], s["label"]) for s in data.dev_only] == [("N", "dev only, not gated")]
    assert {p.gate for p in data.points if p.stack == "K"} == {"accepted"}

    figures.frontier_figure(data, tmp_path / "frontier.png")  # both step lines drawn
    assert (tmp_path / "frontier.png").stat().st_size > 0

    from orchestrate.cli.app import app

    proto.write(PROTOCOL, tmp_path / "protocol.yaml")
    shown = CliRunner().invoke(
        app, ["frontier", "--db", store.url, "--protocol", str(tmp_path / "protocol.yaml")]
    )
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    (gated,) = [line for line in lines if line.startswith("best gated:")]
    assert gated.startswith(f"best gated: {headline_cell(k_held)} holdout paired (K)")
    assert FLAG in gated
    (dev,) = [line for line in lines if line.startswith("dev only, not gated:")]
    assert "(N)" in dev and "R" not in dev
    assert f"Pareto set: none, quality {NM}" in lines  # random weights: no quality axis


# ------------------------------------------------------------------ 3. ledger causes


def test_ledger_causes_are_facts(store: Store) -> None:
    # rows as an older classifier stored them: any SIGKILL near an OOM word was `oom`
    for name, cause, detail in [
        ("A", "oom", "worker killed by SIGKILL (out of memory?) (worker log: w.log)"),
        ("B", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"),
        ("C", "oom", "worker killed by SIGKILL (out of memory: the kernel's OOM killer ended it)"),
        ("D", "crash", "worker killed by SIGTERM (worker log: w.log)"),
    ]:
        store.record_failure(name, cause, detail)
    # and as this one stores them: a SIGKILL without evidence is no OOM
    assert classify_failure("worker killed by SIGKILL (out of memory?) (worker log: w)") == "crash"

    rule = SpeedRule(min_speedup=1.2, resamples=300)
    m, s = measured(stack("M"), 1.03, 7), measured(stack("S"), 0.9, 8)
    run_id = run(store, "remeasure", [m, s], 0, model=REAL)
    base = measured(STOCK, 1.0, 0)
    for cand in (m, s):
        verdict = decide.judge(cand, [decide.speed_check("remeasure", base, cand, rule)])
        decide.record(
            store, run_id=run_id, stack=cand.stack, verdict=verdict, speedup=1.0, evidence={},
            **COMMON,
        )  # fmt: skip

    causes = {e["stack_name"]: e["cause"] for e in ledger.entries(store)}
    assert causes == {
        "A": "killed (signal 9)", "B": "oom", "C": "oom", "D": "killed (signal 15)",
        "M": "below the noise bar", "S": "slower",
    }  # fmt: skip
    stored = {e["stack_name"]: e["stored_cause"] for e in ledger.entries(store)}
    assert stored["M"] == "slower" and stored["A"] == "oom"  # the column's closed set
    assert {e["stack_name"] for e in ledger.entries(store, cause="killed")} == {"A", "D"}
    assert {e["stack_name"] for e in ledger.entries(store, cause="oom")} == {"B", "C"}
    text = ledger.render(ledger.entries(store), ledger.decision_rows(store), [])
    assert "| M | below the noise bar |" in text and "| S | slower |" in text
    assert "| A | killed (signal 9) |" in text


# -------------------------------------------------------------- 4. random weights


def test_quality_on_random_weights_is_never_ok_or_fail(store: Store) -> None:
    from orchestrate.cli.common import console
    from orchestrate.cli.protocol import _gate_summary

    assert decide.random_weights(RANDOM) and not decide.random_weights(REAL)
    # Piper's preset without `weights` loads its trained voice: the family says so
    assert not decide.random_weights(ModelSpec(family="piper", preset="piper-joe"))

    held = run(store, "holdout", [measured(K, 1.6, 2)], 0, model=RANDOM)
    verdict = decide.judge(
        measured(K, 1.6, 2), [ok_speed()], [gate(passed=False)], random_weights=True
    )
    assert verdict.verdict == "accept"  # speed decided; quality was not judged
    assert verdict.quality == NM and "gate" not in verdict.causes
    assert f"wer: {NM}" in verdict.reasons
    assert not any(r.startswith(("wer: ok", "wer: FAIL")) for r in verdict.reasons)
    (g,) = verdict.to_dict()["gates"]
    assert g["passed"] is None and g["why"] == NM
    stock_q, cand_q = StackQuality(values={}), StackQuality(values={}, coverage_failures=3)
    coverage = decide.check_coverage(stock_q, cand_q, PROTOCOL.quality, random_weights=True)
    assert coverage.passed is None and coverage.line() == f"coverage: {NM}"

    out = record(store, held, verdict)
    (row,) = ledger.decision_rows(store)
    assert row["view"]["quality"] == NM and f"quality not judged ({NM})" in row["view"]["why"]
    assert "every gate held" not in ledger.render([], ledger.decision_rows(store), [])
    report = {
        "candidate": "K", "against": "stock", "workload": "smoke", "hardware": "Test CPU",
        "protocol": "default v1", "headline": {}, "record": out,
    }  # fmt: skip
    with console.capture() as captured:
        _gate_summary(report, verdict.to_dict(), 0.95)
    shown = captured.get()
    assert f"wer: {NM}" in shown and "wer: ok" not in shown

    # approximate on random weights: unverified, whatever its scores would say
    approx = StackSpec(name="Q", techniques=[TechniqueRef(name="codebook_head")])
    run(store, "dev", [measured(approx, 1.4, 9).model_copy(update={"exact": False})], 5)
    (q,) = [p for p in collect(store, PROTOCOL, "smoke").points if p.stack == "Q"]
    assert q.quality == NM and q.status == "unverified" and NM in q.reasons[0]


def test_quality_on_real_weights_stays_judged(store: Store) -> None:
    held = run(store, "holdout", [measured(K, 1.6, 2)], 0, model=REAL)
    verdict = decide.judge(measured(K, 1.6, 2), [ok_speed()], [gate()], random_weights=False)
    assert verdict.quality == "judged" and "wer: ok Δ +0.01" in verdict.reasons
    record(store, held, verdict)
    (row,) = ledger.decision_rows(store)
    assert row["view"]["why"] == "every gate held"  # and only here
    bad = decide.judge(measured(K, 1.6, 2), [ok_speed()], [gate(passed=False)])
    assert bad.verdict == "retain" and "wer: FAIL Δ +0.2" in bad.reasons


# ------------------------------------------------------------------------ 5. MLflow


def test_mlflow_carries_the_decisions(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrate.running import mlflow_log
    from orchestrate.store import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)

    def tracked(model: ModelSpec, minute: int) -> tuple[str, str]:
        run_id = run(store, "holdout", [measured(K, 1.66, 2)], minute, model=model)
        res = store.get_result(run_id)
        parent = tracking.log_run(res, run_id, comparisons(res))
        children = tracking.stack_run_ids(parent)
        store.set_mlflow_run_ids(run_id, parent, children)
        return run_id, children["K"]

    held, child = tracked(REAL, 0)
    verdict = decide.judge(measured(K, 1.66, 2), [ok_speed()], [gate()], [FLAG], allow_flagged=True)
    out = record(store, held, verdict, speedup=3.76)
    hold = headline(store, held, "K")

    mlf = tracking.client()
    data = mlf.get_run(child).data
    assert data.tags["gate.verdict"] == "accept" and data.tags["champion"] == "true"
    assert data.tags["gate.headline"] == "holdout paired" and FLAG in data.tags["gate.overridden"]
    assert data.tags["gate.quality"] == "judged" and data.tags["gate.quality.wer"] == "ok Δ +0.01"
    assert data.metrics["gate.speedup_paired"] == hold["speedup_paired"]
    assert data.metrics["gate.speedup_paired_lo"] == hold["speedup_paired_lo"]
    assert data.metrics["quality.wer"] == pytest.approx(0.06)
    assert data.metrics["quality.wer.delta"] == pytest.approx(0.01)
    assert data.metrics["gate.holdout.speedup"] == 1.6

    name = decide.registry_name("rumik", "tiny:float32", "smoke", "Test CPU")
    assert out["mlflow_model"] == f"models:/{name}@champion"
    version = tracking.champion_version(name)
    tags = version["tags"]
    assert version["run_id"] == child and tags["stack"] == "K"
    assert tags["gate.headline"] == "holdout paired" and FLAG in tags["gate.overridden"]
    assert float(tags["gate.speedup_paired"]) == pytest.approx(hold["speedup_paired"], rel=1e-3)
    lo, hi = hold["speedup_paired_lo"], hold["speedup_paired_hi"]
    assert tags["gate.speedup_paired_ci"] == f"[{lo:.4g}, {hi:.4g}]"

    experiment = mlf.get_experiment(mlf.get_run(child).info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    # a retain on random weights: the verdict lands, quality as not meaningful, no scores
    held_r, child_r = tracked(RANDOM, 5)
    slow = decide.SpeedCheck("holdout", "stock", 8, 0.9, 0.8, 0.95, 0.95, 1.0, "point", False)
    retain = decide.judge(measured(K, 0.9, 2), [slow], [gate()], random_weights=True)
    record(store, held_r, retain)
    data = mlf.get_run(child_r).data
    assert data.tags["gate.verdict"] == "retain" and data.tags["gate.quality"] == NM
    assert data.tags["gate.quality.wer"] == NM and "slower" in data.tags["gate.causes"]
    assert not any(k.startswith("quality.") for k in data.metrics)

    # sync-mlflow logs a run again: its decisions go with it
    (synced,) = mlflow_log.sync_mlflow(store, [held])
    assert synced.error is None
    new_child = store.get_run(held, utterances=False)["stacks"][1]["mlflow_run_id"]
    assert new_child != child
    assert mlf.get_run(new_child).data.tags["gate.verdict"] == "accept"
