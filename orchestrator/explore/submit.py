"""How an exploration's jobs reach a worker: through the executor (running.executor).

The loop hands a `Submitter` planned jobs and gets one recorded `Outcome` per job back, in
order; it never starts a worker itself (the gate's jobs come through it too).
`LocalSubmitter` puts them on the executor `executor_for` picks at the exploration's start:
a live pool (`orchestrate workers`), whose workers run them, or this process, running them
one after another in a worker subprocess kept warm for the whole exploration (running.warm:
the model is built once), or a fresh one per job.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from orchestrate.running.executor import Executor, LocalExecutor, PoolExecutor, Submission, submit
from orchestrate.running.runner import Outcome

__all__ = ["LocalSubmitter", "Submission", "Submitter"]


class Submitter(Protocol):
    slots: int  # jobs it runs at once

    def submit(self, jobs: list[Submission]) -> list[Outcome]:
        """Run `jobs` and record each; one Outcome per job, in order, each with its result
        (also when the identical experiment was recorded before and served back)."""
        ...

    def close(self) -> None:
        """Release its workers (the exploration stopped or was interrupted)."""
        ...


class LocalSubmitter:
    """The exploration's jobs on a live pool when there is one on the database, else in one
    worker subprocess here: kept warm between jobs (`warm`, the default) or a fresh one."""

    def __init__(
        self,
        store: Any,
        runs_dir: Path,
        *,
        track: bool,
        on_event: Callable[[dict[str, Any]], None] = lambda e: None,
        warm: bool = True,
    ) -> None:
        store.reap_dead()
        self.executor: Executor
        if pool := len(store.live_workers()):
            self.executor = PoolExecutor(store, on_event=on_event, slots=pool)
        else:
            self.executor = LocalExecutor(
                store, runs_dir, track=track, on_event=on_event, warm=warm
            )
        self.slots = self.executor.slots

    def submit(self, jobs: list[Submission]) -> list[Outcome]:
        return submit(self.executor, jobs)

    def close(self) -> None:
        self.executor.close()
