"""GPU memory per stack, measured in the worker (none on a CPU).

Several stacks share one process and one model, so the process's peak (`peak_memory_bytes`)
says what the job needed, not what a stack needs: on the H200 every stack of a job reported
the same ~58.6 GB, stock included. Per stack, from torch's allocator (live tensors):

- `gpu_model_gb`: what the model held before any engine was built (shared by every stack);
- `gpu_engine_gb`: what building this stack's engine and warming it up allocated and kept
  (int8 copies, static caches, captured graphs' outputs; negative if it freed model tensors);
- `gpu_transient_gb`: the most its timed utterances allocated above what was live when each
  began (activations, workspaces), the largest over its utterances;
- `gpu_needed_gb`: their sum, what this stack needs alone in a fresh process, up to the
  allocator's caching (reserved but free blocks, e.g. a graph's private pool, are not counted).

What a process allocates once, on first use, is charged to the stack that first uses it:
cuBLAS's workspace (32 MiB on the H200) went to stock, the first stack warmed up, in
tests/test_gpu_memory.py. A stack alone in a fresh process (`--baseline S --stack S`) has
none of that bias: exp74-full read 7.10 + 3.18 + 0.42 = 10.69 GB, the process's own peak.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

GB = 1e9
METRICS = ("gpu_model_gb", "gpu_engine_gb", "gpu_transient_gb", "gpu_needed_gb")


@dataclass
class StackMemory:
    """Allocations per stack over one job; every method is a no-op off CUDA."""

    device: torch.device
    model_bytes: int | None = None
    held: dict[str, int] = field(default_factory=dict)
    transient: dict[str, int] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def model_built(self) -> None:
        if self.on_gpu:
            self.model_bytes = torch.cuda.memory_allocated(self.device)

    @contextmanager
    def holding(self, stack: str) -> Iterator[None]:
        """What `stack` allocates inside and keeps (its engine build, its warm-up)."""
        before = torch.cuda.memory_allocated(self.device) if self.on_gpu else 0
        try:
            yield
        finally:
            if self.on_gpu:
                kept = torch.cuda.memory_allocated(self.device) - before
                self.held[stack] = self.held.get(stack, 0) + kept

    @contextmanager
    def timing(self, stack: str) -> Iterator[None]:
        """The peak one timed utterance of `stack` allocates above what was live."""
        if not self.on_gpu:
            yield
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        yield
        above = torch.cuda.max_memory_allocated(self.device) - before
        self.transient[stack] = max(self.transient.get(stack, 0), above)

    def metrics(self, stack: str) -> dict[str, float]:
        if self.model_bytes is None or stack not in self.held:
            return {}
        transient = self.transient.get(stack, 0)
        parts = (self.model_bytes, self.held[stack], transient)
        return dict(zip(METRICS, [p / GB for p in (*parts, sum(parts))], strict=True))
