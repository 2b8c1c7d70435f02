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

from orchestrate.api.records import ResultRecord
from orchestrate.running.runner import comparisons
from orchestrate.store.rows import result_record


def rebuild(run: dict) -> ResultRecord:
    record = result_record(run)
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
