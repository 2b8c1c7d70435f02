"""Time per engine slot, for `Family.slot_profile`: put a timer on each slot's part, run
one short synthesis, read each slot's own time (its calls minus the slots they called).

A family wires its slots with `Patches` (every attribute it sets is put back, in reverse
order, so the engine is restored exactly) and reads `SlotClock.ms_per_step`.

Profile only outside the timed rounds: every timed call synchronises the device, which a
real run never does. A call made while torch.compile traces or a CUDA graph captures is
never timed (a clock there would break the trace or the capture), and a compiled region or
a replayed graph does not call back into Python: that time lands on the slot whose Python
call encloses it (a captured loop reports its inner slots as part of `loop`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from orchestrate.api.device import sync


def _tracing() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class SlotClock:
    """Self time per slot: a nested slot's time is subtracted from its caller's."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False  # off during the warm-up synthesis
        self.self_s: dict[str, float] = {}
        self._inner: list[float] = []  # per open call: time spent in slots it called

    def call(self, slot: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # Tracing first: a compiled region must not read (and so guard on) `active`, or
        # switching the clock on would recompile it inside the measurement.
        if _tracing() or not self.active:
            return fn(*args, **kwargs)
        sync(self.device)  # work queued before the call belongs to the caller
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            sync(self.device)
            elapsed = time.perf_counter() - t0
            inner = self._inner.pop()
            self.self_s[slot] = self.self_s.get(slot, 0.0) + elapsed - inner
            if self._inner:
                self._inner[-1] += elapsed

    def ms_per_step(self, steps: int) -> dict[str, float]:
        """Each called slot's own milliseconds per step (slots never called are left out)."""
        if steps <= 0:
            return {}
        return {s: 1000.0 * t / steps for s, t in self.self_s.items() if t > 0}


class Timed:
    """A callable part behind the clock. Attribute reads go to the part (a sampler's
    `reset`), so loops that look for optional methods still find them."""

    def __init__(self, clock: SlotClock, slot: str, part: Callable[..., Any]) -> None:
        self._clock, self._slot, self._part = clock, slot, part

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._clock.call(self._slot, self._part, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._part, name)


class Patches:
    """Attributes set for a profile, each put back by `restore` (reverse order): an
    attribute the object held itself gets its old value, a class attribute it shadowed is
    deleted again."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, bool, Any]] = []
        self._methods_timed: dict[int, Any] = {}  # id -> part (held: ids stay unique)

    def set(self, obj: Any, name: str, value: Any) -> bool:
        """False where the object refuses (frozen, __slots__): that part stays untimed."""
        own = name in getattr(obj, "__dict__", {})
        old = obj.__dict__[name] if own else None
        try:
            setattr(obj, name, value)
        except (AttributeError, TypeError):
            return False
        self._undo.append((obj, name, own, old))
        return True

    def time_methods(self, clock: SlotClock, slot: str, part: Any, names: Iterable[str]) -> None:
        """Time these methods of `part` in place (every holder of the part sees the timer)."""
        if id(part) in self._methods_timed:
            return
        self._methods_timed[id(part)] = part
        for name in names:
            method = getattr(part, name, None)
            if callable(method):
                self.set(part, name, functools.partial(clock.call, slot, method))

    def restore(self) -> None:
        while self._undo:
            obj, name, own, old = self._undo.pop()
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._methods_timed.clear()
