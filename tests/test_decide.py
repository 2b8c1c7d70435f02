"""Accept/retain logic: paired bootstrap speed, gates, verdicts, champions and their record."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from factories import result_record, stack_result, utterances

from orchestrate.api.config import StackSpec, TechniqueRef
from orchestrate.api.protocol import Gate, Protocol, ProtocolError, QualitySpec, SpeedRule
from orchestrate.research import decide
from orchestrate.research.scoring_run import StackQuality
from orchestrate.running.runner import comparisons
from orchestrate.store.store import Store

STOCK = StackSpec(name="stock")
FAST = StackSpec(name="fast", techniques=[TechniqueRef(name="static_kv_cache")])


# ------------------------------------------------------------------------------- speed


def test_pairs_match_prompt_seed_and_round() -> None:
    base, cand = utterances(1.0), utterances(0.5)
    pairs = decide.paired_log_ratios(base, cand)
    assert len(pairs) == 8
    assert all(lr == pytest.approx(math.log(2)) for _, lr in pairs)
    # an utterance the baseline lacks has no pair; it is not compared with another round
    assert len(decide.paired_log_ratios(base[:5], cand)) == 5


def test_bootstrap_is_reproducible_and_brackets_the_point() -> None:
    rule = SpeedRule(resamples=500, seed=7)
    logs = [math.log(x) for x in (1.3, 1.5, 1.4, 1.6, 1.2, 1.5)]
    first = decide.bootstrap_speedup(logs, [1.0] * 6, rule)
    assert first == decide.bootstrap_speedup(logs, [1.0] * 6, rule)
    point, lo, hi = first
    assert lo < point < hi
    assert point == pytest.approx(math.exp(sum(logs) / 6))
    # a constant ratio has no spread: the interval collapses onto it
    assert decide.bootstrap_speedup([math.log(2)] * 5, [1.0] * 5, rule) == pytest.approx(
        (2.0, 2.0, 2.0)
    )


def test_speed_must_clear_the_noise_not_just_one() -> None:
    base = stack_result(STOCK, 1.0, jitter=0.02, seed=1)
    clear = stack_result(FAST, 1 / 1.5, jitter=0.02, seed=2)
    check = decide.speed_check("remeasure", base, clear, SpeedRule(min_speedup=1.1))
    assert check.passed and check.n_pairs == 8 and check.ci_low > 1.1
    assert "CI lower bound > 1.100" in check.reason()
    # 3% faster on average, but the noise floor measured by A/A runs is 5%: not accepted
    marginal = stack_result(FAST, 1 / 1.03, jitter=0.05, seed=3)
    check = decide.speed_check("remeasure", base, marginal, SpeedRule(min_speedup=1.05))
    assert not check.passed and check.speedup > 1.0
    # holdout is judged on the point estimate against 1.0 ("faster on holdout")
    point = decide.speed_check(
        "holdout", base, marginal, SpeedRule(min_speedup=1.05), judge_on="point", threshold=1.0
    )
    assert point.passed == (point.speedup > 1.0)


def test_prompt_weights_shift_the_estimate_and_must_cover_every_prompt() -> None:
    base = stack_result(STOCK, 1.0)
    cand = base.model_copy(
        update={
            "stack": FAST,
            "utterances": [
                u.model_copy(update={"latency_s": u.latency_s / (3 if u.prompt_id == "p0" else 1)})
                for u in base.utterances
            ],
        }
    )
    even = decide.speed_check("r", base, cand, SpeedRule())
    heavy = decide.speed_check("r", base, cand, SpeedRule(weights={"p0": 10.0, "*": 1.0}))
    assert even.speedup == pytest.approx(3 ** (1 / 4))
    assert heavy.speedup == pytest.approx(3 ** (10 / 13))
    with pytest.raises(ProtocolError, match="matches no speed weight"):
        decide.speed_check("r", base, cand, SpeedRule(weights={"p1*": 1.0}))


# ----------------------------------------------------------------------------- quality


def quality(coverage: int = 0, **values: float) -> StackQuality:
    return StackQuality(values=dict(values), coverage_failures=coverage)


SPEC = QualitySpec(
    gates=[
        Gate(metric="wer", max_delta=0.02),
        Gate(metric="mos", min_delta=-0.1),
        Gate(metric="sim", min_value=0.6),
    ]
)


def test_gates_compare_candidate_with_stock() -> None:
    stock = quality(wer=0.05, mos=3.9, sim=0.85)
    ok = decide.check_gates(stock, quality(wer=0.06, mos=3.85, sim=0.8), SPEC)
    assert [g.passed for g in ok] == [True, True, True]
    bad = decide.check_gates(stock, quality(wer=0.09, mos=3.7, sim=0.5), SPEC)
    assert [g.passed for g in bad] == [False, False, False]
    assert bad[0].delta == pytest.approx(0.04) and "> +0.02" in bad[0].why
    assert "0.5 < 0.6" in bad[2].why
    missing = decide.check_gates(stock, quality(mos=3.9, sim=0.8), SPEC)
    assert not missing[0].passed and missing[0].why == "no scored data"


def test_coverage_failures_count_against_the_candidate() -> None:
    spec = QualitySpec()
    assert decide.check_coverage(quality(1), quality(1), spec).passed
    worse = decide.check_coverage(quality(0), quality(2), spec)
    assert not worse.passed and worse.delta == 2


def test_verdicts_and_their_causes() -> None:
    ok_speed = decide.SpeedCheck("remeasure", "stock", 8, 1.5, 1.4, 1.6, 0.95, 1.05, "ci_low", True)
    slow = decide.SpeedCheck("remeasure", "stock", 8, 1.02, 0.97, 1.08, 0.95, 1.05, "ci_low", False)
    gate_ok = decide.GateCheck("wer", "wer Δ ≤ +0.02", 0.05, 0.06, 0.01, True, "Δ +0.01")
    gate_bad = decide.GateCheck("wer", "wer Δ ≤ +0.02", 0.05, 0.1, 0.05, False, "Δ +0.05")
    cand = stack_result(FAST, 0.6)

    accepted = decide.judge(cand, [ok_speed], [gate_ok])
    assert accepted.verdict == "accept" and accepted.quality == "judged"
    assert not accepted.overridden and "wer: ok Δ +0.01" in accepted.reasons
    # 1.02x: faster than stock, but its CI does not clear the 1.05 bar: not "slower"
    v = decide.judge(cand, [slow], [gate_bad])
    assert v.verdict == "retain" and set(v.causes) == {"below the noise bar", "gate"}
    assert "wer" in v.causes["gate"] and "0.970" in v.causes["below the noise bar"]
    slower = decide.SpeedCheck("remeasure", "stock", 8, 0.9, 0.8, 0.96, 0.95, 1.05, "ci_low", False)
    assert set(decide.judge(cand, [slower]).causes) == {"slower"}

    flagged = decide.judge(cand, [ok_speed], [gate_ok], ["re-tuned after seeing holdout"])
    assert flagged.verdict == "retain" and "re-tuned" in flagged.causes["gate"]
    assert not flagged.overridden  # retained on it, not overridden
    allowed = decide.judge(cand, [ok_speed], [gate_ok], ["re-tuned"], allow_flagged=True)
    assert allowed.verdict == "accept" and any("overridden" in r for r in allowed.reasons)
    assert allowed.overridden == ["re-tuned (--allow-holdout-reuse)"]
    assert allowed.to_dict()["overridden"] == allowed.overridden  # in the decision row

    oom = cand.model_copy(update={"status": "failed", "error": "OOM: CUDA out of memory"})
    v = decide.judge(oom, [ok_speed])
    assert v.verdict == "retain" and v.failure == "oom" and not v.causes
    partial = cand.model_copy(update={"status": "partial", "skipped": {"audio_head": "no CUDA"}})
    assert "refused" in decide.judge(partial, [ok_speed]).causes


# ---------------------------------------------------------------------------- recording


def test_accept_makes_a_champion_and_retain_feeds_the_ledger(tmp_path: Path) -> None:
    protocol = Protocol(quality=SPEC)
    slow_spec = StackSpec(name="slowpoke", techniques=[TechniqueRef(name="audio_head")])
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        res = result_record(
            [stack_result(STOCK, 1.0), stack_result(FAST, 0.6), stack_result(slow_spec, 1.0)]
        )
        run_id = store.ingest(res, comparisons(res))
        key = ("rumik", "tiny:float32", "smoke", "Test CPU")
        assert decide.current_champion(store, *key) is None

        accept = decide.judge(res.results[1], [decide.speed_check("r", *res.results[:2], SPEC_S)])
        assert accept.verdict == "accept"
        common = dict(protocol=protocol, family="rumik", model="tiny:float32", workload="smoke")
        out = decide.record(
            store, run_id=run_id, stack=FAST, verdict=accept, hardware="Test CPU",
            speedup=1 / 0.6, evidence={"holdout_run": run_id}, **common,
        )  # fmt: skip
        champ = decide.current_champion(store, *key)
        assert champ is not None and champ["stack_name"] == "fast"
        assert champ["decision_id"] == out["decision_id"]
        assert decide.champion_spec(champ) == FAST
        assert champ["protocol_hash"] == protocol.content_hash()

        retain = decide.judge(
            res.results[2], [decide.speed_check("r", res.results[0], res.results[2], SPEC_S)]
        )
        decide.record(
            store, run_id=run_id, stack=slow_spec, verdict=retain, hardware="Test CPU",
            speedup=1.0, evidence={}, **common,
        )  # fmt: skip
        assert decide.current_champion(store, *key)["stack_name"] == "fast"  # type: ignore[index]
        (failure,) = [f for f in store.list_failures() if f["stack_name"] == "slowpoke"]
        assert failure["cause"] == "slower" and failure["run_id"] == run_id
        verdicts = [(d["stack"], d["verdict"]) for d in decide.list_decisions(store)]
        assert verdicts == [("fast", "accept"), ("slowpoke", "retain")]
        assert decide.list_decisions(store)[1]["reasons"]["causes"]["slower"]


SPEC_S = SpeedRule(min_speedup=1.05, resamples=300)


def test_champion_alias_in_mlflow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrate.store import tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    res = result_record([stack_result(STOCK, 1.0), stack_result(FAST, 0.6)])
    with Store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        run_id = store.ingest(res, comparisons(res))
        parent = tracking.log_run(res, run_id, comparisons(res))
        child = tracking.stack_run_ids(parent)["fast"]
        verdict = decide.judge(res.results[1], [decide.speed_check("r", *res.results, SPEC_S)])
        out = decide.record(
            store, run_id=run_id, stack=FAST, verdict=verdict, protocol=Protocol(quality=SPEC),
            family="rumik", model="tiny:float32", workload="smoke", hardware="Test CPU",
            speedup=1.6, evidence={}, mlflow_stack_run=child,
        )  # fmt: skip
        name = decide.registry_name("rumik", "tiny:float32", "smoke", "Test CPU")
        assert out["mlflow_model"] == f"models:/{name}@champion"
        assert decide.current_champion(store, "rumik", "tiny:float32", "smoke", "Test CPU")[
            "mlflow_model"
        ] == out["mlflow_model"]  # fmt: skip
    version = tracking.champion_version(name)
    assert version["run_id"] == child and version["tags"]["stack"] == "fast"
    # the number it was accepted on, labelled by its run's phase (a dev run here), and
    # nothing overridden
    assert version["tags"]["gate.headline"] == "dev paired"
    assert version["tags"]["gate.overridden"] == "none"
    assert float(version["tags"]["gate.speedup_paired"]) == pytest.approx(
        out["headline"]["speedup_paired"], rel=1e-3
    )
    tags = tracking.client().get_run(child).data.tags
    assert tags["champion"] == "true" and tags["gate.verdict"] == "accept"
