"""The part of the Ray backend that runs on a node, in a slot's actor (running.ray_pool is
the driver's part). It never opens the store or MLflow; but the warm worker it keeps
imports running.runner, which imports the store's module, so a node needs the
`orchestrator` extra installed (not a database) beside Ray."""

from __future__ import annotations

import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Literal

from orchestrate.api.scheduling import Capabilities
from orchestrate.running.runner import stop_worker_in
from orchestrate.running.warm import WarmWorker

TEXT_SUFFIXES = (".json", ".jsonl", ".log", ".txt")  # files whose paths are rewritten


class SlotWorker:
    """The body of a slot's Ray actor: a warm worker subprocess on the actor's GPU (Ray sets
    CUDA_VISIBLE_DEVICES to the one it holds) or CPU, in a scratch folder of the node.

    Jobs run on one long-lived thread of the actor: a worker subprocess is started with
    PR_SET_PDEATHSIG (runner.die_with_parent), which fires when the *thread* that started
    it ends, so a thread per job would kill the warm worker after every job."""

    def __init__(self, name: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="orchestrate-ray-"))
        self.warm = WarmWorker(self.root, name=f"worker-{name.replace(':', '-')}")
        self.jobs: queue.Queue[tuple[Path, queue.Queue[Any]]] = queue.Queue()
        threading.Thread(target=self._serve_jobs, daemon=True, name="jobs").start()

    def probe(self, device: Literal["cpu", "cuda"]) -> str:
        group = entry_points(group="orchestrate.families")
        families = tuple(sorted(ep.name for ep in group))
        return Capabilities.probe(device, families).model_dump_json()

    def pid(self) -> int:
        return os.getpid()

    def measure(self, job_json: str, files: dict[str, bytes]) -> Iterator[dict[str, Any]]:
        """Run one job: yield its events as they come, then {"rc", "files"}: every file of
        its folder, the paths in text files pointing at the driver's folder again."""
        job = json.loads(job_json)
        there = job["output_dir"]
        here = self.root / job["job_id"]
        shutil.rmtree(here, ignore_errors=True)
        job["output_dir"] = str(here)
        here.mkdir(parents=True)
        unpack(here, files, there, str(here))
        (here / "job.json").write_text(json.dumps(job))
        events: queue.Queue[Any] = queue.Queue()
        self.jobs.put((here, events))
        while True:
            item = events.get()
            if isinstance(item, dict):
                yield {"event": item}
                continue
            if isinstance(item, BaseException):
                raise item
            out = pack(here, str(here), there)
            shutil.rmtree(here, ignore_errors=True)
            yield {"rc": item, "files": out}
            return

    def stop_job(self, job_id: str) -> bool:
        """SIGTERM the worker running `job_id` here (the driver saw its claim cancelled);
        False when no such job runs. The warm worker ends after it, as after any stopped job."""
        folder = (self.root / job_id).resolve()
        if folder.parent != self.root.resolve():
            raise ValueError(f"not a job id: {job_id!r}")
        return stop_worker_in(folder)

    def _serve_jobs(self) -> None:
        while True:
            here, events = self.jobs.get()
            try:
                rc = self.warm(
                    here / "job.json", here / "result.json", here / "worker.log", events.put
                )
                events.put(rc)
            except BaseException as exc:  # raised to the driver by measure
                events.put(exc)

    def close(self) -> None:
        self.warm.close()
        shutil.rmtree(self.root, ignore_errors=True)


def pack(folder: Path, old: str, new: str) -> dict[str, bytes]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.suffix in TEXT_SUFFIXES:
                data = data.replace(old.encode(), new.encode())
            out[str(path.relative_to(folder))] = data
    return out


def unpack(folder: Path, files: dict[str, bytes], old: str, new: str) -> None:
    """Write `files` under `folder` (result.json last: its presence means the rest is
    there), rewriting `old` to `new` in text files; a name leaving the folder is refused."""
    root = folder.resolve()
    for name in sorted(files, key=lambda n: n == "result.json"):
        path = (folder / name).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"refusing to write {name!r} outside {folder}")
        data = files[name]
        if path.suffix in TEXT_SUFFIXES:
            data = data.replace(old.encode(), new.encode())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
