"""Weights a run never reads, moved off its device for the run and put back after.

Why: a stack that serves its projections in FP8 reads none of the model's bf16 projection
weights, yet the model keeps them (stock, fidelity and other stacks read them): 5.62 GB of
an H100 that the K/V cache could use. `parked(params)` copies each storage those parameters
live in to host memory, leaves every parameter an empty tensor on its device (so a read
the owner did not declare fails at once, on any device, instead of reading stale bytes)
and, on leaving, puts each storage back and every parameter back into it as the same view
(same offset, shape and strides): parameters that shared a storage (a packed q,k,v,gate,up)
share one again.

What it frees is measured, not inferred: `Parked.freed` is the CUDA allocator's drop when
the storages left (None off CUDA). A storage something else still references (another
engine's view of it) stays allocated, and `freed` says so by coming out smaller than
`bytes`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Parked:
    bytes: int  # the parked storages' bytes, all copied to host memory
    freed: int | None  # device bytes the allocator gave back when they left; None off CUDA


@dataclass
class _Storage:
    host: torch.Tensor  # uint8, every byte of the storage (on a CPU device: the storage itself)
    device: torch.device
    views: list[tuple[torch.nn.Parameter, int, torch.Size, tuple[int, ...]]]


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The whole storage as a uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _park(group: list[torch.nn.Parameter]) -> _Storage:
    """One storage to host memory, its parameters emptied (in a function of its own so no
    local outlives the move and keeps the device storage alive)."""
    device = group[0].device
    whole = _bytes_of(group[0].untyped_storage(), device)
    host = whole if device.type == "cpu" else whole.to("cpu")
    views = [(p, p.storage_offset(), p.shape, p.stride()) for p in group]
    for p in group:
        p.data = torch.empty(0, dtype=p.dtype, device=device)
    return _Storage(host, device, views)


@contextmanager
def parked(params: Iterable[torch.nn.Parameter]) -> Iterator[Parked]:
    """`params` empty for the duration of the block, their storages held in host memory;
    restored exactly (same bytes, same views) on leaving, whatever raised inside. Pass every
    parameter of a storage: one left out keeps the device storage and, after, no longer
    shares it with the parked ones."""
    groups: dict[int, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.untyped_storage().nbytes() == 0:  # already empty (parked by an outer block)
            continue
        group = groups.setdefault(p.untyped_storage().data_ptr(), [])
        if not any(p is q for q in group):
            group.append(p)
    devices = {p.device for group in groups.values() for p in group}
    gc.collect()  # garbage in reference cycles (a freed server's graphs) may hold a storage
    before = {d: _allocated(d) for d in devices}
    saved: list[_Storage] = []
    try:
        for group in groups.values():
            saved.append(_park(group))
        drops = [
            b - a for d, b in before.items() if b is not None and (a := _allocated(d)) is not None
        ]
        yield Parked(
            bytes=sum(s.host.numel() for s in saved),
            freed=sum(drops) if devices and len(drops) == len(devices) else None,
        )
    finally:
        for s in saved:
            storage = s.host.to(s.device).untyped_storage()
            for p, offset, shape, stride in s.views:
                p.data = torch.empty(0, dtype=p.dtype, device=s.device).set_(
                    storage, offset, shape, stride
                )
