"""MLflow from the runner's side: the check before a worker starts, best-effort logging of
a recorded run, and `sync-mlflow` (logging runs that MLflow missed, from the database).

The database is always written first and decides a run's status; everything here only
warns (with the command that replays it) when MLflow fails.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

from orchestrate.api.records import ResultRecord
from orchestrate.store.errors import StoreError, StoreUnavailable

Comparisons = dict[str, dict[str, float]]


def probe_tracking() -> None:
    """The MLflow store must open and be readable; else StoreUnavailable (one line)."""
    try:
        from orchestrate.store import tracking
    except ImportError as exc:
        raise StoreUnavailable(
            f"MLflow is not importable ({exc}): pip install mlflow or pass --no-mlflow"
        ) from exc
    tracking.probe()


def log_to_mlflow(
    store: Any, run_id: str, result: ResultRecord, comps: Comparisons, result_path: Path
) -> tuple[str | None, str | None]:
    """Best effort, after the database holds the run: (MLflow run id, None), or (None, a
    warning naming the command that logs it later). The warning also goes to stderr."""
    try:
        from orchestrate.store import tracking

        parent, children = tracking.log_run_bounded(
            result, run_id, comps, result_path, result_path.parent
        )
        store.set_mlflow_run_ids(run_id, parent, children)
        return parent, None
    except Exception as exc:
        warning = (
            f"MLflow logging failed ({one_line(exc)}); run {run_id} is recorded in the database; "
            f"log it later with: orchestrate sync-mlflow {run_id}"
        )
        print(f"warning: {warning}", file=sys.stderr, flush=True)
        return None, warning


def one_line(exc: BaseException) -> str:
    """An error as one line: store errors are already one; others get their type and the
    first line of their message (MLflow's and SQLAlchemy's run to many)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = (lines[0] if lines else "")[:300]
    return text if isinstance(exc, StoreError) else f"{type(exc).__name__}: {text}".rstrip(": ")


class Synced(NamedTuple):
    run_id: str
    mlflow_run_id: str | None
    error: str | None


def sync_mlflow(store: Any, run_ids: list[str] | None = None) -> list[Synced]:
    """Log to MLflow the named runs (ids or prefixes), or every run holding a result but no
    MLflow run, from the stored records; link each to its MLflow runs and put the gate
    decisions made on it onto its stacks' runs (tracking.log_decision)."""
    from orchestrate.store import tracking

    ids = [store.resolve(r) for r in run_ids] if run_ids else store.runs_without_mlflow()
    done = []
    for run_id in ids:
        try:
            result = store.get_result(run_id)
            stored = store.get_run(run_id, utterances=False).get("result_path")
            path = Path(stored) if stored else None
            parent, children = tracking.log_run_bounded(
                result,
                run_id,
                None,  # comparisons are stored among the stacks' metrics
                path if path and path.is_file() else None,
                path.parent if path else None,  # where the result's WAV paths start
            )
            store.set_mlflow_run_ids(run_id, parent, children)
            for d in store.list_decisions():  # a gated run's verdicts go with it
                if d["run_id"] == run_id and d["stack"] in children:
                    tracking.log_decision(children[d["stack"]], d["reasons"])
            done.append(Synced(run_id, parent, None))
        except Exception as exc:  # one run's failure does not stop the others
            done.append(Synced(run_id, None, one_line(exc)))
    return done
