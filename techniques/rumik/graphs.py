"""The captured decode step that device-side loops (graph_loop, while_graph) replay.

One `CapturedStep` runs the decoder step, the head, the stop head and the device sampler
on device buffers and advances position and step counters on the device, so a CUDA graph of
it replays token after token with no host work. A loop that replays it subclasses
`CapturedLoop`: the loop object, installed in the engine's `loop` slot, owns its captured
state, so each engine keeps its own and no other part needs to know where it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from orchestrate.api.config import SamplingConfig
from orchestrate.families.rumik.engine import Engine, Generation, timed_since, token_budget
from orchestrate.techniques.rumik.cuda_graph import GraphedDecoder
from orchestrate.techniques.rumik.static_kv_cache import StaticDecoder

MIN_CAPACITY = 2048  # tokens the buffers hold at least, so most utterances reuse one capture


class CapturedStep:
    """Buffers and the graphs of one decode step over one decoder; captured on first use.

    `tokens[i]` and `stops[i]` receive step i's token and stop probability; `step` is the
    device-side step counter the captured work reads and advances.
    """

    def __init__(self, engine: Engine, decoder: StaticDecoder, cap: int):
        dev = engine.model.device
        self.graphed = GraphedDecoder(decoder)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(cap, dtype=torch.long, device=dev)
        self.stops = torch.zeros(cap, dtype=torch.float32, device=dev)
        self.cap = cap
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}

    def body(
        self, engine: Engine, allow_end: bool, sampling: SamplingConfig, generator: torch.Generator
    ) -> None:
        hidden = self.graphed.body()  # reads token + position, advances position
        head = engine.head(hidden, self.step)
        stop = engine.stop_probability(hidden).view(1)
        token = engine.sampler(
            head, allow_end=allow_end, force_end=False, sampling=sampling, generator=generator
        ).view(1)
        if allow_end:  # the stop head forces end-of-audio, decided on the device
            token = torch.where(stop > 0.5, engine.model.vocab.end_id, token)
        self.tokens.index_copy_(0, self.step, token)
        self.stops.index_copy_(0, self.step, stop)
        self.graphed.token.copy_(token.view(1, 1))
        self.step.add_(1)

    def capture(
        self,
        engine: Engine,
        allow_end: bool,
        sampling: SamplingConfig,
        generator: torch.Generator,
        then: Callable[[], None] | None = None,
    ) -> torch.cuda.CUDAGraph:
        """Warm the body up on a side stream, undo its advance, capture it. `then` is work
        captured after the body (a WHILE loop's condition kernel); with it the raw graph is
        kept (keep_graph=True) for the caller to clone."""
        state = (self.graphed.pos, self.step, self.graphed.token, engine.sampler.counter)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.body(engine, allow_end, sampling, generator)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=then is not None)
        with torch.cuda.graph(graph):
            self.body(engine, allow_end, sampling, generator)
            if then is not None:
                then()
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)  # undo the warm-up's advance
        return graph

    def graph(
        self, engine: Engine, allow_end: bool, sampling: SamplingConfig, generator: torch.Generator
    ) -> torch.cuda.CUDAGraph:
        if allow_end not in self.graphs:
            self.graphs[allow_end] = self.capture(engine, allow_end, sampling, generator)
        return self.graphs[allow_end]


class CapturedLoop:
    """Base of `loop`-slot objects that replay a CapturedStep. It owns the step (one per
    engine, since the technique installs one loop object per engine), reused across
    utterances while the decoder is the same and the token cap fits."""

    def __init__(self) -> None:
        self.captured: CapturedStep | None = None

    def start(
        self,
        engine: Engine,
        prompt_ids: list[int],
        frames: int | None,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> tuple[CapturedStep, int, torch.Tensor, float]:
        """Prefill and the eager step 0 (it follows the prefill, not a previous step), leaving
        the device buffers ready for captured steps: (step, token cap, first token, prefill s)."""
        model, vocab = engine.model, engine.model.vocab
        cap = token_budget(sampling, frames, vocab.num_quantizers)
        decoder = engine.new_decoder(len(prompt_ids) + cap + 1)
        if not isinstance(decoder, StaticDecoder):
            raise TypeError("a captured loop needs static_kv_cache's decoder (without cuda_graph)")
        state = self.captured
        if state is None or state.graphed.inner is not decoder or state.cap < cap:
            state = self.captured = CapturedStep(engine, decoder, max(cap, MIN_CAPACITY))
        engine.sampler.reset(generator.initial_seed())

        t0 = time.perf_counter()
        hidden = state.graphed.prefill(torch.tensor([prompt_ids], device=model.device))
        prefill_s = timed_since(t0, model.device)
        first = engine.sampler(
            engine.head(hidden, 0),
            allow_end=False,
            force_end=False,
            sampling=sampling,
            generator=generator,
        ).view(1)
        state.tokens[0:1].copy_(first)
        state.graphed.token.copy_(first.view(1, 1))
        state.step.fill_(1)
        return state, cap, first, prefill_s  # first stays on the device: no sync here


def model_stop(tokens: list[int], state: CapturedStep, end_id: int, prefill_s: float) -> Generation:
    """Cut at the first end token; the stop head forced it where its probability was > 0.5."""
    end = tokens.index(end_id)
    stopped = state.stops[end].item() > 0.5
    return Generation(tokens[:end], "stop_head" if stopped else "end_token", prefill_s)
