"""Rebuild a worker result record from a stored run's JSON, so it can be ingested elsewhere.

    python benchmarks/run_to_result.py RUN.json OUT.result.json

`bash benchmarks/gpu_run.sh` brings back `$OUT/NAME.json` (the run as the GPU host's store
holds it, from `orchestrate run --json`) and the job folder's result.json, but a run with
many stacks can exceed what a device call returns, and then only the run JSON comes back.
It holds everything the worker wrote; the store merged the runner's comparisons
(`*_vs_*`, speedups) into each stack's metrics, so those keys are dropped here and `orchestrate
ingest` recomputes them from the same utterances. No other value is touched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator.records import ResultRecord, StackResult
from orchestrator.runner import comparisons


def rebuild(run: dict) -> ResultRecord:
    results = [
        StackResult(
            stack=s["spec"],
            status=s["status"],
            applied=s["applied"],
            skipped=s["skipped"],
            exact=s["exact"],
            error=s["error"],
            setup_s=s["setup_s"],
            warmup_s=s["warmup_s"],
            peak_memory_bytes=s["peak_memory_bytes"],
            utterances=s["utterances"],
            fidelity=s["fidelity"],
            metrics=s["metrics"],
        )
        for s in sorted(run["stacks"], key=lambda s: s["position"])
    ]
    record = ResultRecord(
        job=run["job"],
        status=run["status"].lower(),
        started_at=run["started_at"],
        finished_at=run["ended_at"],
        environment=run["environment"],
        results=results,
        error=run["error"],
    )
    added = {k for keys in comparisons(record).values() for k in keys}
    for r in record.results:
        r.metrics = {k: v for k, v in r.metrics.items() if k not in added}
    return record


def main() -> None:
    src, dst = (Path(p) for p in sys.argv[1:3])
    record = rebuild(json.loads(src.read_text()))
    dst.write_text(record.model_dump_json(indent=1))
    print(f"{dst}: {len(record.results)} stacks, status {record.status}")


if __name__ == "__main__":
    main()
