"""One headline speedup: the paired estimate with its CI, stored once with the run and
printed the same by `show` (table and --json), `frontier`, the gate and `ledger`; noisy runs
are marked in every table and never served back by deduplication; `gate` exit codes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from factories import result_record, stack_result
from typer.testing import CliRunner

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.protocol import Gate, Protocol, QualitySpec
from orchestrate.api.records import ResultRecord
from orchestrate.reports import ledger
from orchestrate.reports.frontier import collect
from orchestrate.reports.tables import headline_cell
from orchestrate.research import decide
from orchestrate.running import metrics, runner
from orchestrate.running.runner import comparisons
from orchestrate.store.store import Store

STOCK = StackSpec(name="stock")
FAST = StackSpec(name="fast", techniques=[TechniqueRef(name="static_kv_cache")])
SLOW_STOCK_S = 25.0  # one contended stock utterance, as in the issue


def contended(when_minutes: int = 0) -> ResultRecord:
    """fast is ~1.6x stock per utterance, but one stock utterance took 25 s: the aggregate
    RTF ratio balloons while the paired estimate moves by one pair's share."""
    from datetime import UTC, datetime, timedelta

    stock = stack_result(STOCK, 1.0, jitter=0.02, seed=1)
    stock.utterances[0] = stock.utterances[0].model_copy(update={"latency_s": SLOW_STOCK_S})
    stock.metrics = metrics.summarize(stock.utterances)
    fast = stack_result(FAST, 1 / 1.6, jitter=0.02, seed=2)
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(minutes=when_minutes)
    return result_record([stock, fast], when)


def quiet(when_minutes: int = 0) -> ResultRecord:
    from datetime import UTC, datetime, timedelta

    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(minutes=when_minutes)
    return result_record(
        [
            stack_result(STOCK, 1.0, jitter=0.02, seed=1),
            stack_result(FAST, 1 / 1.6, jitter=0.02, seed=2),
        ],
        when,
    )


def geometric_mean_of_pairs(result: ResultRecord) -> float:
    """The definition, computed here independently: per (prompt, seed, round), baseline
    RTF / candidate RTF, geometric mean (the default protocol weighs prompts alike)."""
    base = {(u.prompt_id, u.seed, u.round): u for u in result.results[0].utterances}
    logs = [
        math.log((base[k].latency_s / base[k].audio_s) / (u.latency_s / u.audio_s))
        for u in result.results[1].utterances
        if (k := (u.prompt_id, u.seed, u.round)) in base
    ]
    return math.exp(sum(logs) / len(logs))


@pytest.fixture
def store(tmp_path: Path) -> Any:
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as s:
        yield s


def cli(args: list[str], url: str) -> Any:
    from orchestrate.cli.app import app

    return CliRunner().invoke(app, [*args, "--db", url], catch_exceptions=False)


def test_headline_is_the_paired_estimate_not_the_aggregate() -> None:
    result = contended()
    comps = comparisons(result)["fast"]
    expected = geometric_mean_of_pairs(result)
    assert comps["speedup_paired"] == pytest.approx(expected, rel=1e-12)
    assert comps["speedup_paired_lo"] < comps["speedup_paired"] < comps["speedup_paired_hi"]
    assert comps["speedup_paired_n"] == 8
    # the 25 s utterance inflates the aggregate RTF ratio far beyond the paired estimate
    assert comps["speedup_vs_baseline"] > 3 * comps["speedup_paired"]
    # deterministic: the bootstrap is seeded by the protocol
    assert comparisons(contended())["fast"] == comps


def test_every_report_prints_the_one_stored_headline(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    result = contended()
    run_id = store.ingest(result, comparisons(result))
    stored = store.get_run(run_id)["stacks"][1]["metrics"]
    h, agg = stored["speedup_paired"], stored["speedup_vs_baseline"]
    cell = headline_cell(stored)
    assert cell == (
        f"{h:.2f}x [{stored['speedup_paired_lo']:.2f}, {stored['speedup_paired_hi']:.2f}]"
    )
    assert f"{h:.2f}" != f"{agg:.2f}"  # two numbers that a table could confuse

    # show --json: the stored number, and the run is marked noisy
    shown = json.loads(cli(["show", run_id[:8], "--json"], url).stdout)
    assert shown["stacks"][1]["metrics"]["speedup_paired"] == h
    assert shown["noisy"]
    # show's table: the headline cell under its label, the aggregate only as labelled
    table = cli(["show", run_id[:8]], url).stdout
    assert cell in table and "paired" in table and "RTF ratio" in table

    # frontier: the point's speedup is the stored headline, with its CI
    (point,) = collect(store, Protocol(), "smoke").points
    assert point.speedup == h and point.ci_low == stored["speedup_paired_lo"]
    assert point.rtf_ratio == agg
    front = cli(["frontier", "--workload", "smoke"], url)
    assert cell in front.stdout

    # the gate: its speed check and the speedup it records are the stored number
    report = _gate(store, result, monkeypatch)
    assert report["headline"]["speedup_paired"] == h
    assert report["verdict"]["speed"][0]["speedup"] == h
    assert f"{h:.3f}x (paired)" in report["verdict"]["reasons"][0]

    # ledger: the decision (and a champion crowned on that evidence) print the same cell
    decision = decide.list_decisions(store)[-1]
    decide.record(
        store, run_id=run_id, stack=FAST, verdict=decide.Verdict("accept", []),
        protocol=Protocol(), family="rumik", model="tiny:float32", workload="smoke",
        hardware="Test CPU", speedup=h, evidence={"headline": decision["reasons"]["headline"]},
    )  # fmt: skip
    text = ledger.render(
        ledger.entries(store), decide.list_decisions(store), decide.list_champions(store)
    )
    decisions_part, champions_part = text.split("## Champions")
    assert cell in decisions_part.split("## Decisions")[1] and cell in champions_part
    assert "speedup (paired, 95% CI)" in text
    ledger_out = cli(["ledger", "--no-write"], url).stdout
    assert cell in ledger_out


def _gate(store: Store, result: ResultRecord, monkeypatch: pytest.MonkeyPatch) -> Any:
    """run_gate on a recorded result: its remeasure is this (noisy) run, so it retains
    before the holdout is opened."""
    from orchestrate.api.config import ModelSpec, Prompt, Workload
    from orchestrate.research import gate
    from orchestrate.running import executor, plan

    def run_alone(job: Any, store: Store, runs_dir: Path, **kw: Any) -> runner.Outcome:
        comps = comparisons(result)
        run_id = store.find_run_by_identity(runner.job_identity(result.job))["id"]
        return runner.Outcome(run_id, result.status, result, comps, None)

    monkeypatch.setattr(executor, "run_alone", run_alone)  # the gate's jobs go through it
    monkeypatch.setattr(plan, "plan_job", lambda *a, **k: None)
    protocol = Protocol(quality=QualitySpec(gates=[Gate(metric="wer", max_delta=0.02)]))
    dev = Workload(name="smoke", prompts=[Prompt(id="p0", text="x")])
    return gate.run_gate(
        store, candidate=FAST, model=ModelSpec(preset="tiny"), dev=dev, protocol=protocol,
        runs_dir=Path("runs"), track=False,
    )  # fmt: skip


def test_a_noisy_run_is_marked_and_never_reused(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    noisy = contended()
    noisy_id = store.ingest(noisy, comparisons(noisy))
    table = cli(["show", noisy_id[:8]], url).stdout
    assert "NOISY" in table and "noisy:" in table and "spread" in table
    assert "ok · noisy" in table  # the stack row itself
    (point,) = collect(store, Protocol(), "smoke").points
    assert point.status == "alert" and point.noisy
    assert any("noisy run" in r for r in point.reasons)

    spawned: list[Path] = []

    def spawn_worker(job_path: Path, *a: Any) -> int:
        spawned.append(job_path)
        return 1  # no result: the outcome is a failed run, which is all this test needs

    monkeypatch.setattr(runner, "spawn_worker", spawn_worker)
    job = noisy.job.model_copy(update={"job_id": "again-1"})
    out = runner.execute(job, store, tmp_path / "runs", track=False)
    assert not out.reused and len(spawned) == 1  # measured afresh, not served back

    clean = quiet(when_minutes=5)  # the same experiment, recorded later, quiet
    clean_id = store.ingest(clean, comparisons(clean))
    assert json.loads(cli(["show", clean_id[:8], "--json"], url).stdout)["noisy"] == []
    job = noisy.job.model_copy(update={"job_id": "again-2"})
    out = runner.execute(job, store, tmp_path / "runs", track=False)
    assert out.reused and out.run_id == clean_id and len(spawned) == 1


def test_too_few_pairs_is_noisy() -> None:
    one = result_record([stack_result(STOCK, 1.0, n=1), stack_result(FAST, 0.5, n=1)])
    comps = comparisons(one)["fast"]
    assert comps["noisy"] == 1.0
    assert "fewer than" in metrics.noise_reasons("fast", comps)[0]
    assert comparisons(quiet())["fast"]["noisy"] == 0.0


def test_pairs_form_only_within_one_worker() -> None:
    """A resumed run's segments: a pair timed by two workers (a round the interruption cut)
    is left out; records from before `timed_by` fall back to carried-or-not."""
    from factories import utterances

    base, cand = utterances(1.0, n=4), utterances(0.5, n=4)
    assert len(metrics.paired_log_ratios(base, cand)) == 4
    base = [u.model_copy(update={"timed_by": "job-a" if u.round < 2 else "job-b"}) for u in base]
    cand = [u.model_copy(update={"timed_by": "job-a" if u.round < 1 else "job-b"}) for u in cand]
    assert [p for p, _ in metrics.paired_log_ratios(base, cand)] == ["p0", "p2", "p3"]
    old = [u.model_copy(update={"resumed": u.round < 2}) for u in utterances(1.0, n=4)]
    assert len(metrics.paired_log_ratios(old, utterances(0.5, n=4))) == 2


def test_utterances_timed_on_hosts_of_different_speed_are_noisy() -> None:
    """A resumed run's segments can run on other hosts: a stock baseline (no headline of its
    own) timed on a host twice as slow as the rest makes the run noisy; one host's own
    jitter does not; utterances carried from a worker that did not record its host are
    counted, not guessed."""
    from factories import utterances

    def with_hosts(*ms: float | None) -> list:
        utts = utterances(1.0, n=len(ms))
        return [u.model_copy(update={"host_loop_ms": h}) for u, h in zip(utts, ms, strict=True)]

    mixed = metrics.summarize(with_hosts(13.1, 13.0, 26.2, 25.9))
    assert mixed["host_loop_spread"] == pytest.approx(26.2 / 13.0)
    (why,) = metrics.noise_reasons("stock", mixed)
    assert "stock: timed on hosts whose single-thread loop differs 2.02x" in why
    assert metrics.run_noise([("stock", mixed)]) == [why]
    one_host = metrics.summarize(with_hosts(13.1, 12.9, 13.3, 13.0))
    assert metrics.noise_reasons("stock", one_host) == []
    partly = metrics.summarize(with_hosts(None, None, 13.0, 13.1))
    assert partly["host_loop_unrecorded"] == 2.0 and partly["host_loop_spread"] < 1.25
    assert "host_loop_spread" not in metrics.summarize(with_hosts(None, None))

    # A fresh result, as the gate and explore judge it: the candidates' comparisons alone
    # hold no baseline metrics, so its host spread is read from the worker's metrics.
    base = stack_result(STOCK, 1.0)
    base.utterances = with_hosts(13.0, 13.0, 26.0, 26.0, 13.0, 13.0, 26.0, 26.0)
    base.metrics = metrics.summarize(base.utterances)
    result = result_record([base, stack_result(FAST, 0.5)])
    comps = comparisons(result)
    assert metrics.run_noise(list(comps.items())) == []  # what the gate used to read
    (why,) = metrics.result_noise(result, comps)
    assert why.startswith("stock: timed on hosts") and "2.00x" in why


@pytest.mark.parametrize(("verdict", "code"), [("accept", 0), ("retain", 3)])
def test_gate_exit_code_says_the_verdict(
    verdict: str, code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestrate.research import gate

    report = {
        "candidate": "cpu-fast", "against": "stock", "workload": "smoke", "hardware": "cpu",
        "protocol": "default v2", "verdict": {"verdict": verdict, "reasons": []},
        "headline": {"speedup_paired": 1.5, "speedup_paired_lo": 1.4, "speedup_paired_hi": 1.6},
    }  # fmt: skip
    monkeypatch.setattr(gate, "run_gate", lambda *a, **k: report)
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    out = cli(["gate", "--stack", "cpu-fast"], url)
    assert out.exit_code == code, out.stdout
    assert "1.50x [1.40, 1.60]" in out.stdout
    as_json = cli(["gate", "--stack", "cpu-fast", "--json"], url)
    assert as_json.exit_code == code
    assert json.loads(as_json.stdout)["verdict"]["verdict"] == verdict
