"""The technique ladder of one run and serving throughput against batch size, from records.

- ladder: every stack of one stored run with its speed (S where the workload defines
  operating points, else aggregate RTF) and its speedups against the run's baseline (A) and
  any stack declared `baseline: true` (B), recomputed from the record's utterances.
- throughput: across stored runs of one workload on one hardware, utterances per second
  (batch size / median latency) for each stack, grouped by the stack minus its `batch`
  technique, so one line per serving path shows how it scales from batch 1 to 8.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrate.api.protocol import split_phase
from orchestrate.api.records import ResultRecord, StackResult
from orchestrate.research.decide import hardware_key
from orchestrate.running.runner import comparisons

if TYPE_CHECKING:
    from orchestrate.store.store import Store


@dataclass
class Rung:
    stack: str
    exact: bool
    metric: str  # "S" or "rtf"
    value: float
    speedups: dict[str, float] = field(default_factory=dict)  # reference stack -> x


def ladder(result: ResultRecord) -> list[Rung]:
    base = result.results[0].stack.name
    comps = comparisons(result)
    refs = [r.stack.name for r in result.results[1:] if r.stack.baseline]
    rungs = []
    for r in result.results:
        metric = "S" if "S" in r.metrics else "rtf"
        if r.status not in ("ok", "partial") or metric not in r.metrics:
            continue
        key = "s_speedup" if metric == "S" else "speedup"
        c = comps.get(r.stack.name, {})
        speedups = {base: 1.0} if r.stack.name == base else {}
        if f"{key}_vs_baseline" in c:
            speedups[base] = c[f"{key}_vs_baseline"]
        for ref in refs:
            if ref == r.stack.name:
                speedups[ref] = 1.0
            elif f"{key}_vs_{ref}" in c:
                speedups[ref] = c[f"{key}_vs_{ref}"]
        rungs.append(Rung(r.stack.name, r.exact, metric, r.metrics[metric], speedups))
    return rungs


def batch_size(result: StackResult) -> int:
    for t in result.stack.techniques:
        if t.name == "batch":
            return int(t.params.get("size", 8))
    return 1


def serving_path(result: StackResult) -> str:
    names = [t.name for t in result.stack.techniques if t.name != "batch"]
    return " + ".join(names) or "stock"


def finished_runs(store: Store, workload: str) -> list[dict]:
    """Finished (or partial) runs of `workload` in any phase, oldest first."""
    return [
        r
        for r in sorted(store.list_runs(limit=10_000), key=lambda r: (r["started_at"], r["id"]))
        if split_phase(r["workload_name"])[0] == workload and r["status"] in ("FINISHED", "PARTIAL")
    ]


def throughput(
    store: Store, workload: str, hardware: str | None = None
) -> dict[str, dict[int, float]]:
    """serving path -> {batch size: utterances/s}, the newest measurement of each point on
    one hardware (the newest run's unless given)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    runs = sorted(store.list_runs(limit=10_000), key=lambda r: (r["started_at"], r["id"]))
    runs = [
        r
        for r in runs
        if split_phase(r["workload_name"])[0] == workload and r["status"] in ("FINISHED", "PARTIAL")
    ]
    results = [store.get_result(r["id"]) for r in runs]
    if hardware is None and results:
        hardware = hardware_key(results[-1].environment)
    for result in results:
        if hardware_key(result.environment) != hardware:
            continue
        for r in result.results:
            latency = r.metrics.get("median_latency_s")
            if r.status in ("ok", "partial") and latency:
                out[serving_path(r)][batch_size(r)] = batch_size(r) / latency
    return {k: dict(sorted(v.items())) for k, v in out.items()}
