"""The decode loop as one captured CUDA graph per token, with no host round trip per token.

Each replay runs the decoder step, the head, the stop head and the device sampler, writes
the token and stop probability into device buffers and advances position and step counters
on the device. Under a length policy the host replays the known number of steps and reads
the tokens once at the end; when the model decides the length, the host reads the buffers
once per `check_every` tokens (one 80 ms frame by default) and discards what was generated
past the end. Tokens still depend on previous tokens; only the checking moves off the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from pydantic import Field

from orchestrate.api.config import SamplingConfig
from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, Generation, timed_since, token_budget
from orchestrate.techniques.rumik.cuda_graph import GraphedDecoder, graphs_twice
from orchestrate.techniques.rumik.static_kv_cache import StaticDecoder


class GraphLoopParams(TechniqueParams):
    check_every: int = Field(
        8, ge=1, le=256, description="Tokens between host checks (model length)."
    )


class _Captured:
    """Buffers and the graph for one engine; captured on first use."""

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


def start(
    engine: Engine,
    prompt_ids: list[int],
    frames: int | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> tuple[_Captured, int, torch.Tensor, float]:
    """Prefill and the eager step 0 (it follows the prefill, not a previous step), leaving
    the device buffers ready for captured steps: (state, token cap, first token, prefill s)."""
    model, vocab = engine.model, engine.model.vocab
    cap = token_budget(sampling, frames, vocab.num_quantizers)
    decoder = engine.new_decoder(len(prompt_ids) + cap + 1)
    if not isinstance(decoder, StaticDecoder):
        raise TypeError("a captured loop needs static_kv_cache's decoder (without cuda_graph)")
    state: _Captured = engine.notes.get("graph_loop_state")
    if state is None or state.graphed.inner is not decoder or state.cap < cap:
        state = engine.notes["graph_loop_state"] = _Captured(engine, decoder, max(cap, 2048))
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


def graph_loop(
    engine: Engine,
    prompt_ids: list[int],
    frames: int | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Generation:
    vocab = engine.model.vocab
    params: GraphLoopParams = engine.notes["graph_loop"]
    state, cap, first, prefill_s = start(engine, prompt_ids, frames, sampling, generator)
    min_tokens = sampling.min_tokens_before_stop
    if frames is not None:
        graph = state.graph(engine, False, sampling, generator)
        for _ in range(cap - 1):
            graph.replay()
        tokens = state.tokens[:cap].tolist()  # the one host sync of the utterance
        return Generation(tokens, "length_policy", prefill_s)

    done, tokens = 1, [int(first.item())]
    while done < cap:
        n = min(params.check_every, cap - done)
        for k in range(n):
            allow_end = done + k >= min_tokens
            state.graph(engine, allow_end, sampling, generator).replay()
        tokens += state.tokens[done : done + n].tolist()  # one host sync per chunk
        done += n
        if vocab.end_id in tokens:
            return model_stop(tokens, state, vocab.end_id, prefill_s)
    return Generation(tokens, "token_cap", prefill_s)


def model_stop(tokens: list[int], state: _Captured, end_id: int, prefill_s: float) -> Generation:
    """Cut at the first end token; the stop head forced it where its probability was > 0.5."""
    end = tokens.index(end_id)
    stopped = state.stops[end].item() > 0.5
    return Generation(tokens[:end], "stop_head" if stopped else "end_token", prefill_s)


class GraphLoop(Technique):
    name = "graph_loop"
    family = "rumik"
    exact = True
    slots = ("loop",)
    requires = ("cuda",)
    after = ("static_kv_cache", "device_sampler")
    conflicts = ("cuda_graph",)
    summary = "Whole decode step (+head, stop head, sampler) in one graph; no per-token sync."
    Params = GraphLoopParams

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        return graphs_twice(earlier)

    def apply(self, engine: Engine) -> None:
        engine.notes["graph_loop"] = self.params
        engine.loop = graph_loop
