"""`orchestrate diff`: only what differs between two stored runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate.api.config import TechniqueRef
from orchestrate.api.records import ResultRecord
from orchestrate.reports.run_diff import ABSENT, diff_runs
from orchestrate.store.store import Store


def changed_copy(result: ResultRecord) -> ResultRecord:
    """The same job on another GPU/driver, fast's codebook_head at top_k 16 and 10% slower,
    plus a stack the first run did not have."""
    stock, fast = result.results
    refs = [
        TechniqueRef(name=t.name, params={"top_k": 16} if t.name == "codebook_head" else t.params)
        for t in fast.stack.techniques
    ]
    fast_spec = fast.stack.model_copy(update={"techniques": refs})
    slower = {k: v * 1.1 if k != "tokens_per_s" else v / 1.1 for k, v in fast.metrics.items()}
    extra = fast.model_copy(update={"stack": fast_spec.model_copy(update={"name": "extra"})})
    job = result.job.model_copy(
        update={"job_id": "second0002", "stacks": [stock.stack, fast_spec, extra.stack]}
    )
    env = result.environment.model_copy(
        update={"driver": "580.159.04", "sm_clock_mhz": 1980.0 * 1.001}  # clock: within noise
    )
    return result.model_copy(
        update={
            "job": job,
            "environment": env,
            "results": [
                stock,
                fast.model_copy(update={"stack": fast_spec, "metrics": slower}),
                extra,
            ],
        }
    )


@pytest.fixture
def two_runs(tmp_path: Path, make_result_record) -> tuple[str, str, str]:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    first = make_result_record(job_id="first00001")
    with Store(url) as store:
        a = store.ingest(first)
        b = store.ingest(changed_copy(first))
    return url, a, b


def test_diff_shows_only_what_changed(two_runs) -> None:
    url, a, b = two_runs
    with Store(url) as store:
        d = diff_runs(store.get_run(a, utterances=False), store.get_run(b, utterances=False))
    settings = {c.key: (c.a, c.b) for c in d.settings}
    assert settings == {"environment.driver": ("570.86", "580.159.04")}  # clock within 2%
    assert d.only_in_a == [] and d.only_in_b == ["extra"]
    fast = {c.key: (c.a, c.b) for c in d.stacks["fast"]}
    assert fast == {"techniques.codebook_head.top_k": (8, 16)}
    assert "stock" not in d.stacks
    moved = {(m.stack, m.metric): m.ratio for m in d.metrics}
    assert set(moved) == {("fast", k) for k in ("rtf", "median_latency_s", "tokens_per_s")}
    assert moved[("fast", "rtf")] == pytest.approx(1.1)
    assert moved[("fast", "tokens_per_s")] == pytest.approx(1 / 1.1)
    assert d.unchanged_metrics == 3  # stock's three are equal

    with Store(url) as store:
        run_a, run_b = store.get_run(a), store.get_run(b)
    strict = diff_runs(run_a, run_b, threshold=0.0)
    assert "environment.sm_clock_mhz" in {c.key for c in strict.settings}
    same = diff_runs(run_a, run_a)
    assert not (same.settings or same.stacks or same.metrics or same.only_in_b)


def test_diff_of_a_technique_added_and_an_order_change(two_runs) -> None:
    url, a, _ = two_runs
    with Store(url) as store:
        run = store.get_run(a, utterances=False)
    other = {**run, "id": "other", "stacks": [dict(s) for s in run["stacks"]]}
    fast = other["stacks"][1]
    techniques = [*reversed(fast["spec"]["techniques"]), {"name": "pdl", "params": {}}]
    fast["spec"] = {**fast["spec"], "techniques": techniques}
    keys = {c.key: (c.a, c.b) for c in diff_runs(run, other).stacks["fast"]}
    assert keys["techniques.pdl"] == (ABSENT, {})
    assert keys["order"] == (
        ["static_kv_cache", "codebook_head"],
        ["codebook_head", "static_kv_cache", "pdl"],
    )


def test_diff_cli_table_json_and_bad_ids(two_runs, tmp_path: Path) -> None:
    url, a, b = two_runs

    def cli(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "orchestrate.cli", "diff", *args, "--db", url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)

    shown = cli(a[:8], b[:8])
    assert shown.returncode == 0, shown.stderr
    assert "580.159.04" in shown.stdout and "codebook_head" in shown.stdout
    assert "1.1x" in shown.stdout
    missing = cli(a, "nosuchrun")
    assert missing.returncode == 2 and "nosuchrun" in missing.stderr
    negative = cli(a, b, "--threshold", "-1")
    assert negative.returncode == 2 and "threshold" in negative.stderr.lower()
