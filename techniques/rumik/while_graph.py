"""The decode loop as one conditional CUDA WHILE graph: the device decides when to stop.

graph_loop still replays one captured step per token from the host. Here one launch runs
the whole utterance:

    entry A -> WHILE A { step, end token masked ; keep_decoding }
            -> entry B -> WHILE B { step, end allowed, stop head forces it ; keep_decoding }

Phase A covers the tokens before `min_tokens_before_stop` (every token under a length
policy), phase B the rest. `keep_decoding` sets each loop's condition from device memory:
step < limit, and in phase B the last token is not the end token (the stop head forces
the end token on the device, so both stops look the same). Token, position, RNG counter,
codebook index (step % 8) and cache length all advance inside the captured step, exactly
as in graph_loop (both replay techniques/rumik/graphs.py's captured step), so the tokens are
graph_loop's tokens (a GPU test checks it); the host launches once and synchronises once per
utterance.
"""

from __future__ import annotations

import torch

from orchestrate.api.config import SamplingConfig
from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, Generation
from orchestrate.techniques.rumik.cuda_graph import graphs_twice
from orchestrate.techniques.rumik.graphs import CapturedLoop, CapturedStep, model_stop
from orchestrate.techniques.rumik.kernels.while_node import WhileGraph


class _Phases:
    """The outer graph for one captured step, plus the limits its phases read."""

    def __init__(
        self,
        engine: Engine,
        state: CapturedStep,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ):
        dev = engine.model.device
        self.state = state
        self.sampling = sampling  # baked into the captured sampler
        self.limits = torch.zeros(2, dtype=torch.long, device=dev)  # phase A, phase B
        self.graph = WhileGraph(dev)
        end_id = engine.model.vocab.end_id
        for phase, allow_end in enumerate((False, True)):
            handle = self.graph.handle()
            limit = self.limits[phase : phase + 1]
            end = end_id if allow_end else -1

            def condition(handle: int = handle, limit: torch.Tensor = limit, end: int = end):
                self.graph.condition(handle, state.step, limit, state.tokens, end)

            entry = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(entry):
                condition()
            body = state.capture(engine, allow_end, sampling, generator, then=condition)
            self.graph.phase(handle, entry, body)


class WhileLoop(CapturedLoop):
    """The `loop` slot: one launch of the WHILE graph per utterance. Owns the phases built
    for its captured step (rebuilt when the step or the sampling settings change)."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: _Phases | None = None

    def __call__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        frames: int | None,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Generation:
        vocab = engine.model.vocab
        state, cap, _, prefill_s = self.start(engine, prompt_ids, frames, sampling, generator)
        loop = self.phases
        if loop is None or loop.state is not state or loop.sampling != sampling:
            loop = self.phases = _Phases(engine, state, sampling, generator)
        free = cap if frames is not None else min(cap, max(1, sampling.min_tokens_before_stop))
        loop.limits[0].fill_(free)
        loop.limits[1].fill_(cap)
        loop.graph.launch()
        ran = int(state.step.item())  # the one host sync of the utterance
        tokens = state.tokens[:ran].tolist()
        if frames is not None:
            return Generation(tokens, "length_policy", prefill_s)
        if vocab.end_id in tokens:
            return model_stop(tokens, state, vocab.end_id, prefill_s)
        return Generation(tokens, "token_cap", prefill_s)


class WhileGraphLoop(Technique):
    name = "while_graph"
    family = "rumik"
    exact = True
    slots = ("loop",)
    requires = ("cuda", "package:cuda.bindings")
    reduces = ("host",)  # one graph launch a step instead of a launch per kernel
    after = ("static_kv_cache", "device_sampler")
    conflicts = ("cuda_graph",)
    summary = "Whole utterance in one conditional CUDA WHILE graph; the device decides the stop."

    @classmethod
    def check_stack(
        cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]
    ) -> str | None:
        return graphs_twice(earlier)

    def apply(self, engine: Engine) -> None:
        engine.loop = WhileLoop()
