"""Device helpers for families and techniques: `sync`, and kernel launches per decode step
counted on the GPU (None on a CPU).

Two numbers per generated token, from torch.profiler (CUPTI) around the engine's own token
loop, differenced between two lengths so prefill, the first step and one-off work cancel:

- `kernels_per_step`: kernels the GPU executes per token (graph-replayed kernels included:
  CUPTI reports kernels launched by a graph like any other), memcpy/memset excluded;
- `launches_per_step`: host launch calls per token (cudaLaunchKernel*, cuLaunchKernel*, and
  cudaGraphLaunch/cuGraphLaunch, each counting as one): what the CPU must issue. Under
  cuda_graph this is ~1; under graph_loop with a length policy it is the one graph per token.
  Kernels inside a conditional WHILE node (while_graph) are invisible to CUPTI: measured on
  the H200, the count comes back 0, so kernels_per_step is then left out, not reported as 0.
- `gpu_busy_ms_per_step`: milliseconds per token during which the GPU executed anything
  (kernels, copies, sets; the union of their intervals, so overlapping kernels under PDL
  count once). Beside the wall time per token it says how much of a step is host work:
  for stock, most of it. Left out when the profiler saw no device activity (while_graph).

`interpreting`, `l2_copies` and `graph_ms_per_call` serve kernel modules and their sweeps:
Triton's CPU interpreter, and a kernel's GPU time from CUDA-graph replay beyond the L2.
`interleaved_replay_ms` times several captured graphs against each other, replay by replay.

`graph_kernel_nodes` counts the kernel nodes of a captured torch.cuda.CUDAGraph (built with
keep_graph=True) through cuda-bindings, to cross-check the profiler on a graph.

`sync_sites` counts the host-device synchronisations torch flags while a block runs, by the
lines of a source tree that made them: where a pipelined host waits for the GPU.

`device_activity` records what the GPU ran while a block runs (each kernel, copy and set:
name, stream, start, end) and `kernel_time` sums it: busy time overall and per stream, and
the kernels that took the most of it. Where a step's device time goes when several streams
share the GPU (a server's decode graph beside its codec).
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

_HOST_LAUNCH_MARKERS = ("LaunchKernel", "GraphLaunch", "LaunchCooperativeKernel")


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, which runs eagerly)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without the host waiting for work queued before (a
    pageable copy synchronizes with the stream): pinned and non-blocking on CUDA (the
    caching host allocator keeps the pinned block until the copy has run); on the CPU,
    `t` moved as is."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@contextlib.contextmanager
def sync_sites(root: Path, depth: int = 2) -> Iterator[Counter[str]]:
    """Every host-device synchronisation torch flags while the block runs (a blocking copy,
    `.item()`, a stream or device synchronize: `torch.cuda.set_sync_debug_mode("warn")`),
    counted by where code under `root` made it: its innermost `depth` frames there,
    innermost first ("a.py:12 f < b.py:40 g"); "(outside ...)" when none is. Counts nothing
    off CUDA. A wait torch does not flag (the driver's, a pinned allocation) is not here."""
    counts: Counter[str] = Counter()
    if not torch.cuda.is_available():
        yield counts
        return
    base = str(root.resolve())
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchronizing CUDA operation" not in str(message):
            shown(message, category, filename, lineno, *rest)
            return
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if f.filename.startswith(base) and "site-packages" not in f.filename
        ]
        site = " < ".join(
            f"{os.path.relpath(f.filename, base)}:{f.lineno} {f.name}"
            for f in reversed(frames[-depth:])
        )
        counts[site or f"(outside {base})"] += 1

    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(mode)


def count_launches(fn: Callable[[], Any], device: torch.device) -> dict[str, float] | None:
    """Kernels executed, host launch calls made and GPU-busy microseconds while `fn` runs;
    None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = launches = 0
    busy: list[tuple[float, float]] = []
    # The raw events, not prof.events(): building that tree of FunctionEvents for a
    # host-bound loop (stock: thousands of ops a token) took 20-27 s on the H200, far
    # longer than the profiled run itself; these are the same records, unparsed.
    for ev in prof.profiler.kineto_results.events():
        name = ev.name()
        if ev.device_type() == DeviceType.CUDA:
            busy.append((ev.start_ns() / 1000, ev.end_ns() / 1000))
            if not name.startswith(("Memcpy", "Memset", "memcpy", "memset")):
                kernels += 1
        elif any(m in name for m in _HOST_LAUNCH_MARKERS):
            launches += 1
    return {"kernels": kernels, "launches": launches, "busy_us": union_us(busy)}


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of (start, end) intervals: time the device was busy."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextlib.contextmanager
def device_activity() -> Iterator[list[tuple[str, int, int, int]]]:
    """Yield a list that, after the block, holds (name, stream, start_ns, end_ns) for each
    kernel, copy and set the GPU ran during it (CUPTI, through torch.profiler; kernels inside
    a graph replay included). Refused off CUDA: no activity would read as an idle GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("device_activity needs CUDA: a CPU records no device activity")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    out: list[tuple[str, int, int, int]] = []
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield out
        torch.cuda.synchronize()
    for ev in prof.profiler.kineto_results.events():  # raw events: see count_launches
        if ev.device_type() == DeviceType.CUDA:
            out.append((ev.name(), ev.device_resource_id(), ev.start_ns(), ev.end_ns()))


def kernel_time(
    activity: Sequence[tuple[str, int, int, int]], top: int = 25, name_chars: int = 120
) -> dict[str, Any]:
    """Sum device activity (device_activity's tuples): `busy_ms`, the union over all streams
    (time anything ran); per stream its summed and union milliseconds; and the `top` names
    by summed milliseconds, with their calls and streams. Names are cut to `name_chars`
    (template-heavy GEMM names run to thousands)."""
    by_stream: dict[int, list[tuple[float, float]]] = {}
    by_name: dict[str, list[float]] = {}
    streams_of: dict[str, set[int]] = {}
    for name, stream, start, end in activity:
        by_stream.setdefault(stream, []).append((start / 1e3, end / 1e3))
        key = name[:name_chars]
        by_name.setdefault(key, []).append((end - start) / 1e6)
        streams_of.setdefault(key, set()).add(stream)
    every = [iv for ivs in by_stream.values() for iv in ivs]
    ranked = sorted(by_name.items(), key=lambda kv: sum(kv[1]), reverse=True)
    return {
        "busy_ms": union_us(every) / 1e3,
        "span_ms": (max(b for _, b in every) - min(a for a, _ in every)) / 1e3 if every else 0.0,
        "streams": {
            str(s): {
                "ms": sum(b - a for a, b in ivs) / 1e3,
                "busy_ms": union_us(ivs) / 1e3,
                "events": len(ivs),
            }
            for s, ivs in sorted(by_stream.items())
        },
        "top": [
            {"name": k, "calls": len(v), "ms": sum(v), "streams": sorted(streams_of[k])}
            for k, v in ranked[:top]
        ],
    }


def per_step(
    run: Callable[[int], int], device: torch.device, short: int = 1, long: int = 3
) -> dict[str, float] | None:
    """Per-token launch counts of a token loop. `run(frames)` generates `frames` frames and
    returns how many tokens it made; the counts of `long` minus `short` frames over the
    difference in tokens are per decode step. None off CUDA."""
    if device.type != "cuda":
        return None
    run(short)  # anything first-use (capture, autotuning) happens outside the counts
    counts: list[tuple[int, dict[str, int]]] = []
    for frames in (short, long):
        made: list[int] = []
        c = count_launches(lambda f=frames, made=made: made.append(run(f)), device)
        if c is None:
            return None
        counts.append((made[0], c))
    (t1, c1), (t2, c2) = counts
    if t2 <= t1:
        return None
    steps = t2 - t1
    out = {"launches_per_step": (c2["launches"] - c1["launches"]) / steps}
    kernels = c2["kernels"] - c1["kernels"]
    if kernels > 0:  # CUPTI does not see kernels run inside conditional graph nodes
        out["kernels_per_step"] = kernels / steps  # (while_graph): no count beats a 0
    busy_us = c2["busy_us"] - c1["busy_us"]
    if busy_us > 0:
        out["gpu_busy_ms_per_step"] = busy_us / steps / 1000
    return out


def graph_kernel_nodes(graph: torch.cuda.CUDAGraph) -> int:
    """Kernel nodes in a captured graph (torch.cuda.CUDAGraph(keep_graph=True)), via
    cuda-bindings' cudaGraphGetNodes / cudaGraphNodeGetType."""
    from cuda.bindings import runtime as cudart

    raw = graph.raw_cuda_graph()
    err, _, n = cudart.cudaGraphGetNodes(raw)
    _check(cudart, err, "cudaGraphGetNodes")
    err, nodes, n = cudart.cudaGraphGetNodes(raw, n)
    _check(cudart, err, "cudaGraphGetNodes")
    kernel = cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel
    count = 0
    for node in nodes[:n]:
        err, kind = cudart.cudaGraphNodeGetType(node)
        _check(cudart, err, "cudaGraphNodeGetType")
        count += int(kind) == int(kernel)
    return count


def _check(cudart: Any, err: Any, what: str) -> None:
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err}")


# --------------------------------------------------------------------------- kernel timing


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def l2_copies(device: torch.device, nbytes: int, factor: int = 4) -> int:
    """How many copies of an nbytes operand together exceed `factor` x the device's L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    return max(1, math.ceil(factor * l2 / max(1, nbytes)))


def graph_ms_per_call(calls: Sequence[Callable[[], object]], replays: int = 10) -> float:
    """Mean ms per call of `calls` captured back to back in one CUDA graph.

    Graph replay removes the host launch cost (the Python wrappers take tens of microseconds,
    more than the kernels), so this times the GPU work and the launch gaps a graph keeps.
    Give calls over operand copies larger than the L2 to time HBM traffic.
    """
    for call in calls:  # compile and allocate outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (replays * len(calls))


def interleaved_replay_ms(
    graphs: Mapping[str, torch.cuda.CUDAGraph], replays: int
) -> dict[str, list[float]]:
    """Each graph's ms per replay, `replays` times, the graphs taking turns (so a clock or
    thermal drift falls on all of them alike); each replay timed by CUDA events alone."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(replays):
        for name, graph in graphs.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return times
