"""An exploration's budget: wall time ("2h", "30m", "1h30m", "90s"), worker jobs ("200 jobs"),
or both ("2h, 200 jobs"); whichever runs out first stops it.

Time counts the whole exploration (proposing, planning, gates), over every session of a
resumed one. A job is one worker job: a development measurement, a fresh-seed remeasure, and
each of the gate's two runs. A job about to start is skipped when the jobs so far say it
would not finish inside the time left: a budget is a promise, not a hint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SECONDS = {"s": 1, "m": 60, "h": 3600}
_TIME = re.compile(r"(\d+(?:\.\d+)?)\s*([hms])")
_JOBS = re.compile(r"^(\d+)\s*jobs?$")


class BudgetError(ValueError):
    """A budget that cannot be read, or one that would let nothing run."""


@dataclass(frozen=True)
class Budget:
    seconds: float | None = None
    jobs: int | None = None

    def describe(self) -> str:
        parts = []
        if self.seconds is not None:
            parts.append(_duration(self.seconds))
        if self.jobs is not None:
            parts.append(f"{self.jobs} jobs")
        return " or ".join(parts)

    def after(self, elapsed_s: float, jobs: int) -> Budget:
        """This budget on top of what an exploration has spent (`explore --resume ID
        --budget T`: T more, not T in all)."""
        return Budget(
            None if self.seconds is None else elapsed_s + self.seconds,
            None if self.jobs is None else jobs + self.jobs,
        )

    def spec(self) -> str:
        """The budget as parse_budget reads it back."""
        parts = [] if self.seconds is None else [f"{self.seconds:g}s"]
        return ", ".join(parts + ([] if self.jobs is None else [f"{self.jobs} jobs"]))

    def spent(
        self,
        elapsed_s: float,
        jobs: int,
        next_job_s: float | None = None,
        needs: int = 1,
        stacks: int | None = None,
    ) -> str | None:
        """Why the budget allows no further step of `needs` jobs (the gate runs two), or
        None. `next_job_s`: what the next job should take, from the jobs so far (None before
        the first), so the last step does not run past the time; `stacks`: in that job."""
        if self.jobs is not None and jobs + needs > self.jobs:
            more = f"; the next step needs {needs}" if needs > 1 and jobs < self.jobs else ""
            return f"budget spent: {jobs} of {self.jobs} jobs{more}"
        if self.seconds is None:
            return None
        if elapsed_s >= self.seconds:
            return f"budget spent: {_duration(elapsed_s)} of {_duration(self.seconds)}"
        if next_job_s is not None and elapsed_s + needs * next_job_s > self.seconds:
            size = "" if stacks is None else f" of {stacks} stacks"
            what = f"a job{size} takes" if needs == 1 else f"{needs} jobs{size} take"
            return (
                f"budget spent: {_duration(elapsed_s)} of {_duration(self.seconds)}, and "
                f"{what} about {_duration(needs * next_job_s)}"
            )
        return None


def parse_budget(text: str) -> Budget:
    """'2h', '30m', '1h30m', '90s', '200 jobs', '200jobs', or a time and a job count
    separated by a comma ('2h, 200 jobs'). Zero or nothing is a BudgetError."""
    seconds: float | None = None
    jobs: int | None = None
    for part in (p.strip().lower() for p in text.split(",")):
        if m := _JOBS.match(part):
            jobs = int(m.group(1))
        elif _whole_time(part):
            seconds = sum(float(n) * _SECONDS[u] for n, u in _TIME.findall(part))
        else:
            raise BudgetError(
                f"cannot read budget {text!r}: give a time (2h, 30m, 1h30m, 90s) or a number "
                "of jobs (200 jobs), or both separated by a comma"
            )
    if seconds == 0 or jobs == 0:
        raise BudgetError(f"budget {text!r} is zero: nothing would be measured")
    return Budget(seconds, jobs)


def _whole_time(part: str) -> bool:
    """'1h30m', '1h 30m': made only of time terms."""
    compact = part.replace(" ", "")
    return bool(compact) and "".join(m.group(0) for m in _TIME.finditer(compact)) == compact


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2g} h" if seconds % 3600 else f"{seconds / 3600:.0f} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.0f} s"
