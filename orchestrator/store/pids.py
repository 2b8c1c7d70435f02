"""Whether the process that owns a RUNNING run still lives (see RunsMixin.reconcile_stale)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

# A process that started this long after its run row cannot be the one that wrote it: the
# pid was reused. Generous because boot time is only known to the second.
PID_REUSE_TOLERANCE = timedelta(seconds=5)


def owner_alive(pid: int | None, run_started: datetime) -> bool:
    """Whether the process that wrote a RUNNING row (pid `pid`) still runs."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, but belongs to another user
    stat = proc_stat(pid)
    if stat is None:  # no /proc (not Linux): the pid exists, trust it
        return True
    state, started = stat
    if state == "Z":  # exited, not yet reaped by its parent
        return False
    return started <= run_started + PID_REUSE_TOLERANCE


def proc_stat(pid: int) -> tuple[str, datetime] | None:
    """Linux: a process's state letter and start time (to tell a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, StopIteration, ValueError):
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after it don't.
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = int(fields[19])  # field 22, starttime, in clock ticks since boot
    started = btime + ticks / os.sysconf("SC_CLK_TCK")
    return fields[0], datetime.fromtimestamp(started, tz=UTC)
