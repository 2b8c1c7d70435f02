"""MLflow for an exploration, best effort as everywhere: one parent run per exploration, and
each candidate's runs (the parent run of every job it was measured in) nested under it and
tagged with the candidate and its decision. The database is written first; a failure here
is a warning, never a lost decision.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from orchestrate.running.mlflow_log import one_line


def start(exploration: dict[str, Any]) -> tuple[str | None, str | None]:
    """(MLflow run id, None) for a new or resumed exploration, or (None, warning)."""
    try:
        from orchestrate.store import tracking

        mlf = tracking.client()
        with tracking.store_lock():
            if exploration.get("mlflow_run_id"):  # resumed: the same parent run again
                mlf.update_run(exploration["mlflow_run_id"], status="RUNNING")
                return exploration["mlflow_run_id"], None
            name = f"orchestrate/{exploration['family']}/{exploration['workload_name']}"
            experiment = _experiment(mlf, name, tracking)  # the runs' own experiment
            run = mlf.create_run(
                experiment,
                run_name=f"explore-{exploration['id'][:8]}",
                tags={
                    "exploration_id": exploration["id"],
                    "kind": "exploration",
                    "family": exploration["family"],
                    "workload": exploration["workload_name"],
                    "hardware": exploration["hardware"],
                    "protocol_hash": exploration["protocol_hash"],
                    "root": exploration["root"]["name"],
                },
            )
            return run.info.run_id, None
    except Exception as exc:
        return None, f"MLflow: {one_line(exc)}; the exploration is recorded in the database"


def _experiment(mlf: Any, name: str, tracking: Any) -> str:
    found = mlf.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    kind = {tracking.EXPERIMENT_KIND_TAG: tracking.EXPERIMENT_KIND}
    return mlf.create_experiment(name, tags=kind)


def nest(parent: str | None, run_ids: list[str | None], tags: dict[str, str]) -> str | None:
    """Nest MLflow runs under the exploration's and tag them; a warning, or None."""
    if not parent:
        return None
    try:
        from orchestrate.store import tracking

        mlf = tracking.client()
        with tracking.store_lock():
            for run_id in filter(None, run_ids):
                mlf.set_tag(run_id, tracking.PARENT_TAG, parent)
                for key, value in tags.items():
                    mlf.set_tag(run_id, key, value[: tracking.MAX_TAG_CHARS])
        return None
    except Exception as exc:
        return f"MLflow: {one_line(exc)}"


def finish(parent: str | None, exploration: dict[str, Any], status: str) -> str | None:
    """The outcome onto the exploration's run (champion, headline, stop reason)."""
    if not parent:
        return None
    try:
        from orchestrate.store import tracking

        mlf = tracking.client()
        with tracking.store_lock():
            mlf.set_tag(parent, "champion", exploration["champion"]["name"])
            mlf.set_tag(parent, "stop_reason", (exploration.get("stop_reason") or "")[:5000])
            for key in ("champion_headline", "champion_lo", "champion_hi", "elapsed_s", "jobs"):
                if exploration.get(key) is not None:
                    mlf.log_metric(parent, key, float(exploration[key]))
            mlf.log_metric(parent, "candidates", float(len(exploration.get("candidates", []))))
            with suppress(Exception):
                mlf.set_terminated(parent, "FINISHED" if status == "FINISHED" else "KILLED")
        return None
    except Exception as exc:
        return f"MLflow: {one_line(exc)}"
