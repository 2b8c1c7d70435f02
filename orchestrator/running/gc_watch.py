"""Python's garbage collections during a serving level, and the option to keep the heap
that exists before it out of them.

A collection of the oldest generation walks every object the collector tracks: once torch
and transformers are imported, hundreds of thousands of them. A serving loop stalls for the
walk and every live stream's next frame waits. Whether one runs inside a level is what
`gc` records (`benchmarks/cpu/serving-gc.json`, the tiny model on this project's CPU: one
young-generation collection in its sustained level, none of the oldest). `watch` records
each collection over a block; `freeze=True` moves the objects alive when the block starts
(the model, its graphs, the imports) into the permanent generation for the block
(`gc.freeze`), so the collections inside it walk only what the block made, and puts them
back after (`gc.unfreeze`), so a long-lived worker does not pin garbage it made before.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

DEFINITION = (
    "Python garbage collections over the level, by generation (0 youngest, 2 the full "
    "heap): how many, their total and longest pause in ms (gc.callbacks, perf_counter); "
    "frozen: whether the heap alive at the level's start was frozen out of them (gc.freeze)"
)


@dataclass
class Collections:
    frozen: bool
    pauses: list[tuple[int, float]] = field(default_factory=list)  # (generation, seconds)
    _started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._started))
            self._started = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"frozen": self.frozen}
        for gen in range(3):
            secs = [s for g, s in self.pauses if g == gen]
            out[f"gen{gen}"] = {
                "count": len(secs),
                "total_ms": 1000 * sum(secs),
                "max_ms": 1000 * max(secs) if secs else 0.0,
            }
        return out


@contextmanager
def watch(freeze: bool = False) -> Iterator[Collections]:
    """Record the collections made while the block runs; with `freeze`, the objects alive
    at its start are frozen out of them until it ends."""
    seen = Collections(frozen=freeze)
    if freeze:
        gc.collect()  # garbage now is not frozen with the live heap
        gc.freeze()
    gc.callbacks.append(seen)
    try:
        yield seen
    finally:
        gc.callbacks.remove(seen)
        if freeze:
            gc.unfreeze()
