"""Committed benchmark results stay readable, ingestable, and agree with their own records."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from orchestrate.api.records import ResultRecord, StackResult, UtteranceRecord
from orchestrate.running.metrics import HEADLINE, headline, prompt_weight, summarize

RESULTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("**/*.result.json"))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_result_records(path):
    result = ResultRecord.read(path)
    assert result.environment.device_name  # the GPU is named beside the numbers
    base = result.results[0]
    for stack in result.results:
        if not stack.utterances:  # a stack that failed in the run says why, and has no numbers
            assert stack.status in ("failed", "refused") and stack.error and not stack.metrics
            continue
        recomputed = summarize(stack.utterances)  # floor metrics also need the engine
        assert {k: stack.metrics[k] for k in recomputed} == pytest.approx(recomputed)
        if stack is not base:
            assert_headline_by_hand(result, base, stack)


def assert_headline_by_hand(result: ResultRecord, base: StackResult, stack: StackResult) -> None:
    """The stored form of the headline (metrics.headline), recomputed from the record's
    utterances by hand: per pair (same prompt, seed, round) baseline time over the stack's,
    a weighted geometric mean with the protocol's prompt weights, inside its own CI."""
    protocol = result.job.protocol
    by_key = {(u.prompt_id, u.seed, u.round): u for u in base.utterances}

    def t(u: UtteranceRecord) -> float:
        return u.latency_s / u.audio_s if protocol.speed_metric == "rtf" else u.latency_s

    def back_to_back(a: UtteranceRecord, b: UtteranceRecord) -> bool:  # one worker timed both
        if a.timed_by and b.timed_by:
            return a.timed_by == b.timed_by
        return a.resumed == b.resumed  # records from before timed_by: carried or not

    pairs = [(u.prompt_id, t(by_key[k]) / t(u)) for u in stack.utterances
             if (k := (u.prompt_id, u.seed, u.round)) in by_key and u.audio_s > 0
             and back_to_back(by_key[k], u)]  # fmt: skip
    weights = [prompt_weight(p, protocol.speed.weights) for p, _ in pairs]
    by_hand = math.exp(
        sum(w * math.log(r) for w, (_, r) in zip(weights, pairs, strict=True)) / sum(weights)
    )
    got = headline(base.utterances, stack.utterances, protocol.speed, protocol.speed_metric)
    assert got[HEADLINE] == pytest.approx(by_hand, rel=1e-9)
    assert got[f"{HEADLINE}_n"] == len(pairs)
    assert got[f"{HEADLINE}_lo"] <= got[HEADLINE] <= got[f"{HEADLINE}_hi"]


def test_there_are_committed_results():
    assert RESULTS, "benchmarks/ should hold at least one result record"
