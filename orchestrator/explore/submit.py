"""How an exploration's jobs reach a worker: the seam a queue of GPU workers plugs into.

The loop hands a `Submitter` planned jobs and gets one recorded `Outcome` per job back, in
order; it never starts a worker itself (the gate's jobs come through it too). `LocalSubmitter`
runs them one after another in a worker subprocess here (runner.execute): by default one
kept warm for the whole exploration (running.warm: the model is built once), or a fresh one
per job. A queue of GPU hosts would implement the same members: `slots` (jobs it can run at
once), `submit` (block until every job of the list is recorded, its result in the store)
and `close` (release its workers), and the loop would not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from orchestrate.api.records import JobSpec
from orchestrate.research import decide
from orchestrate.running.runner import Outcome, comparisons, execute
from orchestrate.running.warm import WarmWorker


@dataclass(frozen=True)
class Submission:
    """A job to run. `force`: measure it even when the identical experiment is recorded
    (fresh-seed remeasures always measure). `recordings_from`: for a job that resumes an
    interrupted run (runner.plan_resume), the old run's folder, whose WAVs it keeps."""

    job: JobSpec
    force: bool = False
    recordings_from: Path | None = None


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
    """One worker subprocess on this machine, one job at a time: kept warm between jobs
    (`warm`, the default) or a fresh one per job."""

    slots = 1

    def __init__(
        self,
        store: Any,
        runs_dir: Path,
        *,
        track: bool,
        on_event: Callable[[dict[str, Any]], None] = lambda e: None,
        warm: bool = True,
    ) -> None:
        self.store, self.runs_dir, self.track, self.on_event = store, runs_dir, track, on_event
        self.warm = WarmWorker(runs_dir) if warm else None

    def submit(self, jobs: list[Submission]) -> list[Outcome]:
        return [self._one(s) for s in jobs]

    def close(self) -> None:
        if self.warm is not None:
            self.warm.close()

    def _one(self, s: Submission) -> Outcome:
        run = lambda force: execute(  # noqa: E731
            s.job,
            self.store,
            self.runs_dir,
            track=self.track,
            force=force,
            on_event=self.on_event,
            recordings_from=s.recordings_from,
            worker=self.warm,
        )
        outcome = run(s.force)
        if not outcome.reused:
            return outcome
        # A recorded identical experiment: its result, unless it was timed on other hardware
        # (job identities name code and protocol, not the device).
        result = self.store.get_result(outcome.run_id)
        if decide.hardware_key(result.environment) != decide.local_hardware(s.job.model.device):
            return run(True)
        outcome.result, outcome.comparisons = result, comparisons(result)
        return outcome
