"""A worker that stays up between jobs: what `orchestrate explore` runs its jobs in.

A fresh worker per job pays, every job, for the imports, the model build (3.38B random
parameters) and the process's first-call costs (cuBLAS, allocator, the codec's first
pass), which land on whichever stack warms up first: on the H200 a job of four stacks took
145 s cold and 105 s warm (benchmarks/h200/issue13-explore-exp74-warm-events).
`WarmWorker` is a drop-in for runner.spawn_worker (execute(..., worker=...)):
the same arguments, the same events, logs and exit status, from one process
(`worker --serve`) that keeps the built model while its checksum holds (worker.ModelCache).

What is measured does not change: every job still builds its engines, warms every stack up
outside the timer and times them interleaved. A job that ends the worker (a kill, a crash,
a failed stack) is reported as spawn_worker would report it, and the next job starts a
fresh worker. So does a job planned on other code (commit, uncommitted changes, technique
sources) than the one the process imported: a job's identity names the code it ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, Any

from orchestrate.running.runner import die_with_parent

WORKER = "orchestrate.running.worker"


class WarmWorker:
    """Call it as runner.spawn_worker; `close()` ends the process (also ended with its
    parent: PR_SET_PDEATHSIG, as every worker)."""

    def __init__(self, log_dir: Path, name: str = "warm-worker") -> None:
        self.log_path = log_dir / f"{name}.log"  # its stderr outside any job
        self.proc: subprocess.Popen[str] | None = None
        self.code: str | None = None  # the commit and tree state the process imported
        self.techniques: dict[str, Any] = {}  # each technique's source, as jobs named it

    def __call__(
        self,
        job_path: Path,
        result_path: Path,
        log_path: Path,
        on_event: Callable[[dict[str, Any]], None],
    ) -> int:
        code, techniques = _code_of(job_path)
        if self.proc is not None and not self._same_code(code, techniques):
            self.close()  # the tree changed since it imported it
        proc = self._process(code)
        self.techniques |= techniques
        with suppress(OSError):  # for describe_exit (was it the OOM killer?) and tests
            job_path.with_name("worker.pid").write_text(f"{proc.pid}\n")
        request = {"job": str(job_path), "out": str(result_path), "log": str(log_path)}
        events_path = job_path.with_name("events.jsonl")
        try:
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it ended since the last job: its exit status says how
                return self._ended(proc, log_path)
            with events_path.open("a", buffering=1) as events:
                answer = self._answer(proc.stdout, events, log_path, on_event)
            if answer is None:  # no exit line: the process died during the job
                return self._ended(proc, log_path)
            rc, last = answer
            if last:  # it ends after a failed job (worker.serve): the next gets a fresh one
                self._reap()
            return rc
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, *, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        else:
            with suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()  # end of requests: it returns
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    # ------------------------------------------------------------------------ internals

    def _same_code(self, code: str, techniques: dict[str, Any]) -> bool:
        """The job names the code this process imported: the same commit and tree state,
        and each of its techniques with the source an earlier job named (a job of other
        stacks names other techniques, which is no change)."""
        return code == self.code and all(
            self.techniques.get(name, source) == source for name, source in techniques.items()
        )

    def _process(self, code: str) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", WORKER, "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=die_with_parent(),
            )
        self.code, self.techniques = code, {}
        return self.proc

    @staticmethod
    def _answer(
        stdout: IO[str],
        events: IO[str],
        log_path: Path,
        on_event: Callable[[dict[str, Any]], None],
    ) -> tuple[int, bool] | None:
        """Relay the job's events until its exit line: (exit status, whether the worker
        ends after it); None when the stream ends first."""
        for line in stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                with log_path.open("a") as log:  # stray prints from libraries
                    log.write(line)
                continue
            if event.get("event") == "exit":
                return int(event["rc"]), bool(event.get("last"))
            events.write(json.dumps({"t": time.time(), **event}) + "\n")
            on_event(event)
        return None

    def _ended(self, proc: subprocess.Popen[str], log_path: Path) -> int:
        """The exit status of a worker that died; its own log's tail goes to the job's log
        when the job's has nothing (it died before the job redirected its stderr)."""
        rc = proc.wait()
        self.proc = None
        own = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        if own.strip() and not (log_path.exists() and log_path.read_text().strip()):
            log_path.write_text("\n".join(own.splitlines()[-40:]) + "\n")
        return rc

    def _reap(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _code_of(job_path: Path) -> tuple[str, dict[str, Any]]:
    """The code a job was planned on, as its identity names it (runner.job_identity): the
    commit and tree state, and the source of each technique its stacks use."""
    job = json.loads(job_path.read_text())
    keys = ("code_sha", "code_dirty", "code_diff_hash")
    return json.dumps({k: job.get(k) for k in keys}, sort_keys=True), job.get(
        "technique_code"
    ) or {}
