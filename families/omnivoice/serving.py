"""OmniVoice serving many requests: the waiting requests generated together, a batch at a time.

Masked diffusion unmasks a whole clip at once, so a request's audio is ready when its batch
finishes: no chunk comes before the last, and its time to first audio is its whole latency
(queueing included). A request that arrives while a batch runs waits for the next one; up to
`rows` requests make one generate() call (the package pads the 2B CFG batch to the longest
row: `generate_many`). The load driver (running/serving.py) timestamps and summarises.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.api.config import OperatingPoint, Workload
from orchestrate.api.family import Serving
from orchestrate.api.technique import Refused
from orchestrate.families.omnivoice.batching import generate_many
from orchestrate.families.omnivoice.engine import Engine
from orchestrate.families.omnivoice.requests import operating_point


@dataclass(frozen=True)
class Request:
    key: int
    text: str
    frames: int


@dataclass(frozen=True)
class Event:
    key: int
    frames_ready: int
    done: bool


class BatchServer:
    """Up to `rows` waiting requests per generate() call, one call per `step`."""

    def __init__(self, engine: Engine, workload: Workload, rows: int):
        points = distinct_points(workload)
        if len(points) > 1:
            raise Refused(mixed_points(workload, len(points)))
        self.engine, self.workload, self.rows = engine, workload, rows
        self.point = points[0]
        self.waiting: list[Request] = []
        self.batches = 0
        self.seed = workload.seeds[0]

    def free_rows(self) -> int:
        return self.rows - len(self.waiting)

    def live(self) -> int:
        return len(self.waiting)

    def admit(self, reqs: list[Request]) -> int:
        n = min(len(reqs), self.free_rows())
        self.waiting.extend(reqs[:n])
        return n

    def step(self) -> list[Event]:
        """Generate every admitted request together; each is then done, all its frames
        ready at once (the frames it got: fewer than asked leave it incomplete)."""
        batch, self.waiting = self.waiting, []
        rate = self.engine.model.frame_rate
        served = generate_many(
            self.engine,
            [r.text for r in batch],
            [r.frames / rate for r in batch],
            self.seed + self.batches,  # a batch's noise: its own seed, reproducible
            self.point,
        )
        self.batches += 1
        return [Event(r.key, f, True) for r, f in zip(batch, served.frames, strict=True)]

    def warm_up(self, frames: int) -> int:
        """One batch at one request and one at `rows` (compiled stacks compile per batch
        shape); returns the batches run. Untimed."""
        text = self.workload.prompts[0].text
        duration = frames / self.engine.model.frame_rate
        sizes = sorted({1, self.rows})
        for n in sizes:
            generate_many(self.engine, [text] * n, [duration] * n, self.seed, self.point)
        self.batches = 0
        return len(sizes)

    def described(self) -> dict[str, str]:
        return {
            "server": f"up to {self.rows} waiting requests generated together in one "
            "generate() call (the 2B CFG batch padded to the longest); a request arriving "
            "during a batch waits for the next",
            "audio": "a request's whole clip is ready when its batch finishes (masked "
            "diffusion: no earlier chunk), so its first audio is its latency",
            "seed": f"batch k draws from seed {self.seed} + k (the package's global generator)",
        }


def distinct_points(workload: Workload) -> list[OperatingPoint]:
    points: list[OperatingPoint] = []
    for prompt in workload.prompts:
        if (point := operating_point(workload, prompt.text)) not in points:
            points.append(point)
    return points


def mixed_points(workload: Workload, n: int) -> str:
    return (
        f"workload {workload.name!r} mixes {n} operating points; a generate() batch shares "
        "one (mode, language, reference): serve one operating point per workload"
    )


def serving(engine: Engine, workload: Workload, streams: int) -> Serving:
    """The server of the engine's `server` slot over `streams` requests of `workload`."""
    load = workload.load
    if load is None or engine.server is None:
        raise Refused("serving needs a serving workload and a stack that fills `server`")
    server: BatchServer = engine.server(engine, workload)
    prompts = workload.prompts
    requests = [
        Request(key=i, text=prompts[i % len(prompts)].text, frames=load.frames)
        for i in range(streams)
    ]
    return Serving(
        server=server,
        requests=requests,
        frames=[load.frames] * streams,
        frame_s=1.0 / engine.model.frame_rate,
        warm_up=lambda: server.warm_up(load.frames),
        described=server.described(),
    )
