"""The record of a worker pool's work, read from its database: each queued job (stacks, where
and when it ran, attempts, its run's status, whether the warm worker reused the model and the
build seconds that saved), the pool's wall time against the sum of the jobs' times, and each
stack's paired headline against the job's baseline, with the environment and git SHA.

    python3 benchmarks/pool_record.py --db sqlite:////tmp/pool.db --out pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from orchestrate.running.runner import comparisons
from orchestrate.store.store import Store


def record(db: str) -> dict:
    with Store(db) as store:
        jobs = sorted(store.list_jobs(limit=1000), key=lambda j: j["submitted_at"])
        rows = []
        for job in jobs:
            row = {k: job[k] for k in ("id", "label", "state", "attempts", "device", "error")}
            row["history"] = job["history"]
            row["claimed_at"], row["finished_at"] = job["claimed_at"], job["finished_at"]
            if job["claimed_at"] and job["finished_at"]:
                row["job_s"] = (job["finished_at"] - job["claimed_at"]).total_seconds()
            if job["run_id"]:
                result = store.get_result(job["run_id"])
                env = result.environment
                row |= {
                    "run_id": job["run_id"],
                    "run_status": result.status,
                    "device_name": env.device_name,
                    "model_reused": env.model_reused,
                    "model_build_s": env.model_build_s,
                    "comparisons": comparisons(result),
                }
            rows.append(row)
        env = None
        if done := [r for r in rows if r.get("run_id")]:
            with Store(db) as s:
                env = s.get_result(done[0]["run_id"]).environment.model_dump(mode="json")
    starts = [r["claimed_at"] for r in rows if r["claimed_at"]]
    ends = [r["finished_at"] for r in rows if r["finished_at"]]
    wall = (max(ends) - min(starts)).total_seconds() if starts and ends else None
    return {
        "what": "jobs drained by `orchestrate workers`, read from the queue and the runs",
        "definitions": {
            "job_s": "a job's claim to its recorded end (model build, engines, warm-up, "
            "timed utterances, recording)",
            "pool_wall_s": "first claim to last recorded end, over all jobs",
            "sum_job_s": "sum of job_s: the wall time one worker would need for the same jobs",
            "model_build_s": "seconds the model build took; when model_reused is true, the "
            "seconds this job did not spend building it",
        },
        "git_sha": os.environ.get("ORCHESTRATE_CODE_SHA"),
        "environment": env,
        "pool_wall_s": wall,
        "sum_job_s": sum(r.get("job_s", 0.0) for r in rows),
        "jobs": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rec = record(a.db)
    a.out.write_text(json.dumps(rec, indent=2, default=str) + "\n")
    for r in rec["jobs"]:
        reuse = "model reused" if r.get("model_reused") else "model built"
        print(
            f"{r['id']} {r['state']} {r.get('job_s', 0):.1f} s on {r['device']}: {r['label']} "
            f"({reuse}, build {r.get('model_build_s') or 0:.1f} s)"
        )
    print(f"pool wall {rec['pool_wall_s']} s, sum of jobs {rec['sum_job_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
