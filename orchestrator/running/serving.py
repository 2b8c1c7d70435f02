"""Serving many streams (issue 34): load shapes, the load driver, and per-stream figures.

A load is N streams arriving together (`concurrency`) or Poisson arrivals at `rate` per
second over `duration_s`. `drive` feeds arrivals to a server (anything shaped like
`Server`: free rows, admit, step) and timestamps, per stream, when each frame's audio is
ready. `summarise` turns those timestamps into the deployer's figures: a stream starts
playing at its first chunk, chunk k is due at first_chunk_ready + k * chunk duration, and a
stream counts as served only if every chunk was ready by its due time and it completed.
Nothing here knows a model family; the server does. `serve_stack` is the worker's serving
job for one stack: the family builds the server (`Family.serving`), this drives it.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from orchestrate.running import gc_watch

DEFINITIONS = {
    "ttfa_s": "time to first audio: ready time of the stream's first chunk (codec included "
    "where the codec runs) minus its arrival time (queueing and prefill included)",
    "underruns": "chunks of a stream ready after their due time; chunk k is due at "
    "first_chunk_ready + k * chunk_frames * frame_s (playback starts at the first chunk)",
    "served": "streams that completed with no underrun",
    "behind": "streams with at least one underrun",
    "incomplete": "streams not finished when the level's time limit stopped it",
    "rtf": "per stream: (last frame ready - arrival) / audio seconds",
    "steady_rtf": "per stream: (last frame ready - first chunk ready) / audio seconds after "
    "the first chunk; below 1 means frames came faster than real time once playing",
    "audio_s_per_s": "aggregate: audio seconds completed by all streams / (last frame ready - "
    "first arrival)",
    "percentiles": "numpy linear interpolation over the level's streams",
    "sustained_window": "a sustained load's figures over the streams arriving in its window "
    "(from one stream's audio length after the start to the last arrival), when the "
    "expected number playing has reached the load's `live`",
    "live_mean": "streams live in the server (admitted, not yet finished), time-weighted "
    "over the sustained window",
    "loop_ms": "the driver's loop, step end to step end (the admissions, the step and its "
    "host work), in ms: p50, p95, p99 and max over the level (or the sustained window); a "
    "frame is 8 steps, so real time allows 10 ms a step on average, and a run of long "
    "steps makes the streams behind; a gap spanning a time with no stream live includes "
    "the driver's wait for the next arrival",
    "gc": gc_watch.DEFINITION,
    "phase_ms_per_step": "where the server times its work: its seconds in each phase (defined "
    "in the record's server description) / decode steps, in ms; `other` is the level's wall "
    "time outside them (the driver's loop, waiting for arrivals)",
    "memory_bytes": "bytes the server holds on its device after warm-up, where it accounts "
    "for them: weights_read (every weight its step reads), weights_copied (the part of those "
    "held beside the model's own tensors, not in them), weights_unread (the model's weights "
    "its step never reads still on the device), cache (its K/V rows); weights_parked (the "
    "unread weights moved to host memory for the run, put back after) and parked_freed "
    "(the CUDA allocator's measured drop when they left)",
}


def phase_breakdown(seconds: dict[str, float], wall_s: float, steps: int) -> dict[str, float]:
    """Each phase's ms per decode step, and `other`: the wall time no phase accounts for."""
    if steps <= 0:
        return {}
    out = {name: 1000 * s / steps for name, s in seconds.items()}
    out["other"] = 1000 * (wall_s - sum(seconds.values())) / steps
    return out


class LoadError(ValueError):
    """A load that cannot be run; raised before any model is built."""


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # streams arriving together at t = 0
    rate: float | None = None  # Poisson arrivals per second
    duration_s: float | None = None  # arrivals stop after this
    # A sustained load (`sustained`): Poisson arrivals at the rate that keeps `live` streams
    # playing on average; figures apart for streams arriving from `window_from_s` on.
    live: int | None = None
    window_from_s: float | None = None

    def label(self) -> str:
        if self.live is not None:
            return f"sustained {self.live} (poisson {self.rate:.4g}/s for {self.duration_s:g} s)"
        if self.rate is not None:
            return f"poisson {self.rate:g}/s for {self.duration_s:g} s"
        return f"{self.concurrency} concurrent"


def sustained(live: int, duration_s: float, stream_s: float) -> Load:
    """Arrivals that keep `live` streams of `stream_s` audio seconds playing on average
    (Little's law: rate = live / stream_s, were each stream to last its audio's length);
    its window opens once the first stream could have ended (`stream_s`), when the
    expected number playing has reached `live`."""
    if live < 1:
        raise LoadError(f"a sustained load needs at least 1 live stream (got {live})")
    if duration_s < 2 * stream_s:
        raise LoadError(
            f"a sustained load of {duration_s:g} s has no sustained window: arrivals must last at "
            f"least twice a stream's {stream_s:g} s"
        )
    return Load(rate=live / stream_s, duration_s=duration_s, live=live, window_from_s=stream_s)


def check_load(load: Load, rows: int) -> None:
    """One line per mistake, before anything is built."""
    if load.rate is None and load.duration_s is not None:
        raise LoadError(f"a duration ({load.duration_s:g} s) needs an arrival rate")
    if load.rate is not None:
        if load.duration_s is None:
            raise LoadError(f"arrival rate {load.rate:g}/s given without a duration")
        if load.rate <= 0 or load.duration_s <= 0:
            raise LoadError("arrival rate and duration must be positive")
        if load.concurrency is not None:
            raise LoadError("give either a concurrency or an arrival rate, not both")
        if load.live is not None and load.live > rows:
            raise LoadError(f"a sustained {load.live} live streams exceed the cache's {rows} rows")
        return
    if load.concurrency is None or load.concurrency < 1:
        raise LoadError(f"concurrency must be at least 1 (got {load.concurrency})")
    if load.concurrency > rows:
        raise LoadError(f"concurrency {load.concurrency} exceeds the cache's {rows} rows")


def load_shape(load: Any, frame_s: float | None) -> Load:
    """A workload's `load:` (api.config.ServingLoad) as the driver's Load; a sustained load
    needs the family's frame length (LoadError where it has none or is too short)."""
    if load.sustained is None:
        return Load(load.concurrency, load.rate, load.duration_s)
    if frame_s is None:
        raise LoadError("a sustained load needs the family's frame length; it declares none")
    return sustained(load.sustained, float(load.duration_s), load.frames * frame_s)


def arrivals(load: Load, seed: int) -> list[float]:
    """Arrival times in seconds from the level's start."""
    if load.rate is None:
        return [0.0] * int(load.concurrency or 0)
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(load.rate)
        if t > float(load.duration_s or 0):
            return out
        out.append(t)


class Server(Protocol):
    def free_rows(self) -> int: ...
    def live(self) -> int: ...
    def admit(self, reqs: list[Any]) -> int: ...
    def step(self) -> list[Any]: ...  # items with .key, .frames_ready, .done


@dataclass
class StreamRecord:
    key: int
    arrival_s: float
    frames: int  # frames the stream should produce
    admitted_s: float | None = None
    frame_ready_s: list[float] = field(default_factory=list)  # per frame, audio ready
    done: bool = False


def drive(
    server: Server,
    requests: Sequence[Any],
    arrival_s: Sequence[float],
    frames: Sequence[int],
    time_limit_s: float,
    clock: Callable[[], float] = time.perf_counter,
    live_trace: list[tuple[float, int]] | None = None,
) -> tuple[list[StreamRecord], float]:
    """Run one load level: admit arrived requests into free rows, step, timestamp frames.

    Returns the records and the level's wall seconds. Past `time_limit_s` the level stops
    and unfinished streams stay incomplete. `live_trace`, if given, gets (seconds, streams
    live) after every step."""
    records = {
        r.key: StreamRecord(r.key, a, f)
        for r, a, f in zip(requests, arrival_s, frames, strict=True)
    }
    pending = deque(sorted(zip(arrival_s, range(len(requests)), strict=True)))
    waiting: list[Any] = []
    t0 = clock()
    while pending or waiting or server.live():
        now = clock() - t0
        if now > time_limit_s:
            break
        while pending and pending[0][0] <= now:
            waiting.append(requests[pending.popleft()[1]])
        if waiting and server.free_rows():
            n = server.admit(waiting)
            for req in waiting[:n]:
                records[req.key].admitted_s = now
            waiting = waiting[n:]
        if not server.live():
            if pending:  # idle until the next arrival
                time.sleep(max(0.0, pending[0][0] - (clock() - t0)))
            continue
        events = server.step()
        now = clock() - t0
        if live_trace is not None:
            live_trace.append((now, server.live()))
        for ev in events:
            rec = records[ev.key]
            rec.frame_ready_s.extend([now] * (ev.frames_ready - len(rec.frame_ready_s)))
            rec.done = rec.done or ev.done
    return list(records.values()), clock() - t0


def stream_figures(rec: StreamRecord, frame_s: float, chunk_frames: int) -> dict[str, Any]:
    ready = rec.frame_ready_s
    n = len(ready)
    out: dict[str, Any] = {
        "arrival_s": rec.arrival_s,
        "frames": n,
        "frames_expected": rec.frames,
        "complete": rec.done and n == rec.frames,
    }
    if not n:
        return {**out, "ttfa_s": None, "underruns": None, "rtf": None, "steady_rtf": None}
    first = ready[min(chunk_frames, n) - 1]
    chunks = math.ceil(n / chunk_frames)
    late = sum(
        ready[min((k + 1) * chunk_frames, n) - 1] > first + k * chunk_frames * frame_s
        for k in range(chunks)
    )
    after = (n - min(chunk_frames, n)) * frame_s
    return {
        **out,
        "ttfa_s": first - rec.arrival_s,
        "underruns": int(late),
        "rtf": (ready[-1] - rec.arrival_s) / (n * frame_s),
        "steady_rtf": (ready[-1] - first) / after if after > 0 else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(
    records: list[StreamRecord],
    frame_s: float,
    chunk_frames: int,
    load: Load | None = None,
    live_trace: Sequence[tuple[float, int]] = (),
) -> dict[str, Any]:
    """The level's figures (definitions in DEFINITIONS), unrounded, plus every stream's;
    for a sustained load, the same figures again over the streams of its window."""
    out = _figures(records, frame_s, chunk_frames) | _loop(live_trace, 0.0, math.inf)
    if load is not None and load.window_from_s is not None:
        start, end = load.window_from_s, float(load.duration_s or 0)
        window = [r for r in records if start <= r.arrival_s <= end]
        block = {
            k: v for k, v in _figures(window, frame_s, chunk_frames).items() if k != "per_stream"
        }
        block |= {"from_s": start, "to_s": end, **_live(live_trace, start, end)}
        out["sustained_window"] = block | _loop(live_trace, start, end)
    return out


def _loop(trace: Sequence[tuple[float, int]], start: float, end: float) -> dict[str, Any]:
    """Percentiles of the driver's step-to-step gaps ending in [start, end] (DEFINITIONS'
    loop_ms), from the trace's timestamps; {} without a trace."""
    gaps = [1000 * (t1 - t0) for (t0, _), (t1, _) in itertools.pairwise(trace) if start < t1 <= end]
    if not gaps:
        return {}
    return {
        "loop_ms_p50": _pct(gaps, 50),
        "loop_ms_p95": _pct(gaps, 95),
        "loop_ms_p99": _pct(gaps, 99),
        "loop_ms_max": max(gaps),
    }


def _live(trace: Sequence[tuple[float, int]], start: float, end: float) -> dict[str, Any]:
    """Streams live over [start, end]: the time-weighted mean and the most, from the
    driver's trace (the count after each step holds until the next)."""
    spans = [
        (min(t1, end) - max(t0, start), n)
        for (t0, n), (t1, _) in itertools.pairwise(trace)
        if t1 > start and t0 < end
    ]
    total = sum(d for d, _ in spans)
    if total <= 0:
        return {"live_mean": None, "live_max": None}
    return {
        "live_mean": sum(d * n for d, n in spans) / total,
        "live_max": max(n for _, n in spans),
    }


def _figures(records: list[StreamRecord], frame_s: float, chunk_frames: int) -> dict[str, Any]:
    streams = [stream_figures(r, frame_s, chunk_frames) for r in records]
    ttfa = [s["ttfa_s"] for s in streams if s["ttfa_s"] is not None]
    rtf = [s["rtf"] for s in streams if s["complete"]]
    steady = [s["steady_rtf"] for s in streams if s["complete"] and s["steady_rtf"] is not None]
    behind = sum(1 for s in streams if s["underruns"])
    served = sum(1 for s in streams if s["complete"] and s["underruns"] == 0)
    last = max((r.frame_ready_s[-1] for r in records if r.frame_ready_s), default=None)
    first_arrival = min((r.arrival_s for r in records), default=0.0)
    audio_s = sum(len(r.frame_ready_s) for r in records) * frame_s
    span = None if last is None else last - first_arrival
    return {
        "streams": len(records),
        "served": served,
        "behind": behind,
        "incomplete": sum(1 for s in streams if not s["complete"]),
        "underruns_total": sum(s["underruns"] or 0 for s in streams),
        "ttfa_p50_s": _pct(ttfa, 50),
        "ttfa_p95_s": _pct(ttfa, 95),
        "ttfa_p99_s": _pct(ttfa, 99),
        "rtf_p50": _pct(rtf, 50),
        "rtf_p95": _pct(rtf, 95),
        "rtf_max": max(rtf) if rtf else None,
        "steady_rtf_p50": _pct(steady, 50),
        "steady_rtf_p95": _pct(steady, 95),
        "audio_s": audio_s,
        "audio_s_per_s": audio_s / span if span else None,
        "per_stream": streams,
    }


def serve_stack(
    family: Any, engine: Any, workload: Any, out_file: Path
) -> tuple[dict[str, float], float]:
    """One run of `workload.load` on one stack's engine: the server's warm-up (graph capture;
    untimed), the load driven to its end or its time limit, the level summarised.

    Returns the `serve.*` metrics (unrounded; definitions in DEFINITIONS, written beside
    them) and the warm-up's seconds; every stream's figures go to `out_file` as JSON."""
    load = workload.load
    shape = load_shape(load, family.frame_s)
    arrived = arrivals(shape, load.arrival_seed)
    if not arrived:
        raise LoadError(
            f"{load.label()} brought no stream (arrival seed {load.arrival_seed}): raise the "
            "rate or the duration"
        )
    setup = family.serving(engine, workload, len(arrived))
    with setup.parked() if setup.parked is not None else nullcontext():
        t0 = time.perf_counter()
        captured = setup.warm_up()
        warm_s = time.perf_counter() - t0
        memory = setup.memory() if setup.memory is not None else None
        trace: list[tuple[float, int]] = []
        with gc_watch.watch() as collected:
            records, wall_s = drive(
                setup.server, setup.requests, arrived, setup.frames, load.time_limit_s,
                live_trace=trace,
            )  # fmt: skip
    level = summarise(records, setup.frame_s, load.chunk_frames, shape, trace)
    level["gc"] = collected.summary()
    if setup.phases is not None:
        steps = int(getattr(getattr(setup.server, "stats", None), "steps", 0))
        level["steps"] = steps
        level["phase_ms_per_step"] = phase_breakdown(setup.phases(), wall_s, steps)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "load": load.model_dump(mode="json"),
        "load_label": load.label(),
        "server": setup.described,
        "graphs_captured": captured,
        "memory_bytes": memory,
        "wall_s": wall_s,
        "definitions": DEFINITIONS,
        **level,
    }
    out_file.write_text(json.dumps(doc, indent=1))
    metrics = {
        f"serve.{key}": float(value)
        for key, value in level.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    metrics |= {
        f"serve.sustained_window.{key}": float(value)
        for key, value in level.get("sustained_window", {}).items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    metrics |= {
        f"serve.phase_ms_per_step.{name}": ms
        for name, ms in level.get("phase_ms_per_step", {}).items()
    }
    metrics |= {f"serve.memory_bytes.{name}": float(n) for name, n in (memory or {}).items()}
    metrics["serve.wall_s"] = wall_s
    return metrics, warm_s
