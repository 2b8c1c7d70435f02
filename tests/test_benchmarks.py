"""Committed benchmark results stay readable, ingestable, and agree with their own records."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrate.api.records import ResultRecord
from orchestrate.running.metrics import compare, summarize

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
            ratio = compare(base.utterances, stack.utterances)["speedup_vs_baseline"]
            assert ratio == pytest.approx(base.metrics["rtf"] / stack.metrics["rtf"])


def test_there_are_committed_results():
    assert RESULTS, "benchmarks/ should hold at least one result record"
