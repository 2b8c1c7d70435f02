"""CUDA graph replay of the decode step.

Stock launches ~15 kernels per layer per token from Python; at batch 1 the GPU idles
between them (24 ms/token against a 1.6 ms bandwidth floor on an H200). Capturing the whole
fixed-shape step (static_kv_cache's decoder) once and replaying it costs one launch per
token. The position lives in device memory and the graph advances it, so replays need no
host writes beyond the token. Exact: the same kernels run, only launched differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine
from orchestrate.techniques.rumik.static_kv_cache import StaticDecoder, StaticKVCacheParams

T = TypeVar("T")


class GraphedDecoder:
    uses_projections = True

    def __init__(self, inner: StaticDecoder):
        self.inner = inner
        dev = inner.k.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.inner.prefill(prompt_ids)
        self.pos.fill_(self.inner.pos)
        return hidden

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.inner._check(self.inner.pos + 1)
        self.token.copy_(token.view(1, 1))
        if self.graph is None:
            self._capture()
        self.graph.replay()  # type: ignore[union-attr]
        self.inner.pos += 1
        return self.hidden  # type: ignore[return-value]

    def body(self) -> torch.Tensor:
        """One step as graph-capturable work: reads token and position from device memory."""
        # _step is the compiled step when static_kv_cache compiles without its own graphs:
        # inductor fuses the small elementwise kernels, this graph removes the launches.
        hidden = self.inner._step(self.token, self.pos)[:, -1]
        self.pos.add_(1)
        return hidden

    def _capture(self) -> None:
        # Warm up on a side stream first (cuBLAS workspaces, Triton autotuning), restoring
        # the position each time: the warm-up writes the same k/v the real step will.
        start = self.pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body()
                self.pos.copy_(start)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.hidden = self.body()
        self.pos.copy_(start)  # capture records but does not run the work
        self.graph = graph


ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # then multiples of 64 (`buckets`)


def buckets(limit: int, small: tuple[int, ...], stride: int) -> list[int]:
    """`small` sizes below `limit`, then multiples of `stride`, ending exactly at `limit`."""
    out = [n for n in small if n < limit]
    n = stride
    while n < limit:
        if not out or n > out[-1]:
            out.append(n)
        n += stride
    return [*out, limit]


def warm_and_capture(
    run: Callable[[], T], pool: Any = None, warmups: int = 2
) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` warmed up on a side stream (cuBLAS workspaces, Triton autotuning), then
    captured into a graph (in `pool`, shared with other graphs, where given); returns the
    graph and what the captured `run` returned (its output buffers). The caller undoes
    whatever the warm-up runs changed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def graphs_twice(earlier: dict[str, TechniqueParams]) -> str | None:
    """Inductor's reduce-overhead mode records its own CUDA graphs; capturing those inside
    another graph fails, so only compile modes without graphs combine with ours."""
    static = earlier.get("static_kv_cache")
    if (
        isinstance(static, StaticKVCacheParams)
        and static.compile
        and static.compile_mode == "reduce-overhead"
    ):
        return (
            "static_kv_cache compiles with mode reduce-overhead (its own CUDA graphs); "
            "use compile_mode default or max-autotune-no-cudagraphs under a captured graph"
        )
    return None


class CudaGraph(Technique):
    name = "cuda_graph"
    family = "rumik"
    exact = True
    wraps = ("decoder",)
    requires = ("cuda",)
    reduces = ("host",)  # one graph launch a step instead of a launch per kernel
    after = ("static_kv_cache",)
    summary = "Capture the fixed-shape decode step once; replay it each token."

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        return graphs_twice(earlier)

    def apply(self, engine: Engine) -> None:
        inner_factory = engine.decoder_factory
        graphed: dict[int, GraphedDecoder] = {}

        def factory(eng: Engine, need: int) -> GraphedDecoder:
            inner = inner_factory(eng, need)
            if not isinstance(inner, StaticDecoder):
                raise TypeError("cuda_graph needs static_kv_cache's decoder")
            return graphed.setdefault(id(inner), GraphedDecoder(inner))

        engine.decoder_factory = factory
