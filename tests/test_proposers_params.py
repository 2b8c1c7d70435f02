"""The `params` proposer: its search space comes from the real techniques' Params models,
its stacks validate, its trials live in the project's database and hear every outcome."""

from __future__ import annotations

import re
from typing import Literal

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from pydantic import Field

from orchestrate.api.config import StackSpec, TechniqueRef, load_stack
from orchestrate.api.proposer import ExplorationState, ProposerError, Tried
from orchestrate.api.registry import build_stack
from orchestrate.api.technique import TechniqueParams
from orchestrate.explore.state import technique_catalogue
from orchestrate.proposers.params import ParamsProposer, distribution, identity, search_space


def state(champion: StackSpec, tried: list[Tried] = (), caps=("cpu",), headline=1.0):
    return ExplorationState(
        family=champion.family,
        device="cpu",
        device_caps=list(caps),
        champion=champion,
        champion_headline=headline,
        root=champion,
        min_speedup=1.05,
        catalogue=technique_catalogue(champion.family),
        tried=list(tried),
    )


def stack(family: str, *techniques: dict) -> StackSpec:
    return StackSpec(name="c", family=family, techniques=[TechniqueRef(**t) for t in techniques])


def tried(proposal, decision="drop", headline=1.5, **quality) -> Tried:
    return Tried(
        stack=proposal.stack,
        change=proposal.change,
        proposer="params",
        decision=decision,
        reason="test",
        headline=headline,
        quality=quality,
    )


@pytest.fixture
def project_db(tmp_path):
    """A project database (the store's schema first, as `explore` has it)."""
    from orchestrate.store.store import Store

    url = f"sqlite:///{tmp_path / 'orchestrate.db'}"
    Store(url).close()
    return url


# ------------------------------------------------------------------- search space


class Demo(TechniqueParams):
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    frac: float = Field(0.5, gt=0, le=1)
    steps: int = Field(8, ge=1, le=128)
    unbounded: int = Field(3, ge=1)
    narrowed: int = Field(16, ge=1, json_schema_extra={"search": [4, 32]})
    pow2: int = Field(64, ge=16, le=256, json_schema_extra={"search": {"choices": [16, 64]}})
    many: tuple[str, ...] = ("x",)


def test_field_ranges_follow_the_params_model():
    f = Demo.model_fields
    assert distribution(bool, f["flag"]) == CategoricalDistribution([False, True])
    assert distribution(f["mode"].annotation, f["mode"]) == CategoricalDistribution(["a", "b"])
    frac = distribution(float, f["frac"])
    assert isinstance(frac, FloatDistribution) and 0 < frac.low < 1e-300 and frac.high == 1
    assert distribution(int, f["steps"]) == IntDistribution(1, 128, log=True)
    assert distribution(int, f["unbounded"]) is None  # no upper bound: not searched
    assert distribution(int, f["narrowed"]) == IntDistribution(4, 32)
    assert distribution(int, f["pow2"]) == CategoricalDistribution([16, 64])
    assert distribution(f["many"].annotation, f["many"]) is None


def test_space_of_ov_a_is_the_decoding_knobs():
    space = search_space(state(load_stack("ov-a")))
    keys = {d.key: d.distribution for d in space.dims}
    assert space.knobs == ["guidance_scale", "num_step", "t_shift"]
    assert keys["num_step.value"] == IntDistribution(4, 32)
    assert keys["guidance_scale.value"] == FloatDistribution(0.0, 4.0)
    assert keys["t_shift.value"] == FloatDistribution(0.05, 1.0)
    assert keys["num_step"] == CategoricalDistribution([False, True])
    assert "position_temperature.value" in space.skipped  # no range declared
    assert "layer_penalty_factor.value" in space.skipped


def test_space_of_a_rumik_champion_reads_its_techniques():
    champion = stack("rumik", {"name": "static_kv_cache"}, {"name": "packed_projections"})
    space = search_space(state(champion))
    keys = {d.key: d.distribution for d in space.dims}
    assert keys["static_kv_cache.compile"] == CategoricalDistribution([False, True])
    assert set(keys["static_kv_cache.compile_mode"].choices) >= {"default", "reduce-overhead"}
    assert keys["packed_projections.fuse_output"] == CategoricalDistribution([False, True])
    assert space.skipped == ["static_kv_cache.max_seq_len"]  # ge only
    assert space.knobs == []  # rumik has no decoding knobs


def test_empty_space_proposes_nothing():
    assert ParamsProposer({"seed": 0}).propose(state(load_stack("stock")), 4) == []


# ---------------------------------------------------------------------- proposals


def test_tpe_proposes_valid_stacks_that_keep_the_champion():
    champion = load_stack("ov-best")
    proposals = ParamsProposer({"seed": 3}).propose(state(champion, caps=("cpu", "cuda")), 6)
    assert len(proposals) == 6
    assert len({identity(p.stack) for p in proposals}) == 6
    kept = [t.name for t in champion.techniques]
    for p in proposals:
        build_stack(p.stack)  # raises on anything invalid
        assert [t.name for t in p.stack.techniques][: len(kept)] == kept
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+", p.stack.name)
        assert p.change and "TPE trial" in p.reason


def test_a_knob_switched_on_is_appended_with_its_value():
    proposals = ParamsProposer({"seed": 1}).propose(state(load_stack("ov-a")), 8)
    added = [p for p in proposals if any(t.name == "num_step" for t in p.stack.techniques)]
    assert added, "eight draws never switched num_step on"
    value = next(t.params["value"] for t in added[0].stack.techniques if t.name == "num_step")
    assert 4 <= value <= 32 and f"+num_step(value={value})" in added[0].change


def test_same_seed_same_proposals_other_seed_other_proposals():
    def run(seed):
        p, seen = ParamsProposer({"seed": seed, "startup_trials": 3}), []
        st = state(load_stack("ov-a"))
        for _ in range(3):  # the model part of TPE runs from the 4th trial on
            out = p.propose(st, 2)
            for prop in out:
                p.observe(prop, tried(prop, headline=1.0 + len(prop.change) / 100))
            seen += [identity(prop.stack) for prop in out]
        return seen

    assert run(7) == run(7)
    assert run(7) != run(8)


# ------------------------------------------------------- storage and observations


def test_trials_round_trip_through_the_project_database(project_db):
    opts = {"seed": 0, "storage_url": project_db, "exploration": "ex1"}
    st = state(load_stack("ov-a"))
    proposer = ParamsProposer(opts)
    first = proposer.propose(st, 3)
    proposer.observe(first[0], tried(first[0], headline=2.5))
    proposer.observe(first[1], tried(first[1], decision="error", headline=None))

    # A restarted exploration: a new proposer on the same study still closes the trial
    # the old one asked for, and numbers go on.
    again = ParamsProposer(opts)
    again.observe(first[2], tried(first[2], decision="invalid"))
    more = again.propose(st, 1)

    storage = optuna.storages.RDBStorage(project_db, skip_compatibility_check=True)
    study = optuna.load_study(study_name="ex1-params", storage=storage)
    trials = {t.number: t for t in study.trials}
    assert trials[0].state == TrialState.COMPLETE and trials[0].value == 2.5
    assert trials[1].state == TrialState.FAIL
    assert trials[2].state == TrialState.FAIL  # invalid: told by the restarted proposer
    assert more and more[0].stack.name.endswith(f".p{len(trials) - 1}")
    from orchestrate.store.store import Store

    Store(project_db).close()  # the project still opens its database


def test_a_database_without_the_project_schema_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'bare.db'}"
    with pytest.raises(ProposerError, match="no orchestrate schema"):
        ParamsProposer({"storage_url": url}).propose(state(load_stack("ov-a")), 1)


def test_gate_refusal_is_complete_but_infeasible():
    proposer = ParamsProposer({"seed": 0})
    [p] = proposer.propose(state(load_stack("ov-a")), 1)
    proposer.observe(p, tried(p, decision="retain", headline=9.0))
    [t] = proposer.study().trials
    assert t.state == TrialState.COMPLETE and t.value == 9.0
    assert t.system_attrs["constraints"] == (1.0,)


def test_duplicates_get_the_earlier_value_and_a_small_space_runs_out():
    # static_kv_cache alone: compile x compile_mode = 6 stacks, one of them the champion.
    champion = stack("rumik", {"name": "static_kv_cache"})
    proposer = ParamsProposer({"seed": 0, "patience": 40})
    history: list[Tried] = []
    for _ in range(10):
        out = proposer.propose(state(champion, history), 2)
        if not out:
            break
        for p in out:
            t = tried(p, headline=1.1)
            proposer.observe(p, t)
            history.append(t)
    assert len(history) == 5  # every other stack once, then nothing left
    assert proposer.propose(state(champion, history), 2) == []
    trials = proposer.study().trials
    told_again = [t for t in trials if t.state == TrialState.COMPLETE and t.value == 1.1]
    assert len(told_again) > 5  # duplicates were told the earlier headline
    assert any(t.value == 1.0 for t in trials)  # the champion: its own headline


def test_nsga2_trades_speed_against_a_quality_metric():
    proposer = ParamsProposer({"seed": 0, "objectives": ["speed", "wer"]})
    p1, p2 = proposer.propose(state(load_stack("ov-a")), 2)
    assert "NSGA-II" in p1.reason
    proposer.observe(p1, tried(p1, headline=2.0, wer=0.12))
    proposer.observe(p2, tried(p2, headline=2.0))  # not scored: no point on the front
    study = proposer.study()
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert isinstance(study.sampler, optuna.samplers.NSGAIISampler)
    t1, t2 = study.trials
    assert t1.values == [2.0, 0.12] and t2.state == TrialState.FAIL


def test_bad_objectives_are_refused():
    with pytest.raises(ProposerError, match="objectives"):
        ParamsProposer({"objectives": ["wer"]})
