"""The decode loop as one captured CUDA graph per token, with no host round trip per token.

Each replay runs the decoder step, the head, the stop head and the device sampler, writes
the token and stop probability into device buffers and advances position and step counters
on the device. Under a length policy the host replays the known number of steps and reads
the tokens once at the end; when the model decides the length, the host reads the buffers
once per `check_every` tokens (one 80 ms frame by default) and discards what was generated
past the end. Tokens still depend on previous tokens; only the checking moves off the host.
The captured step itself is techniques/rumik/graphs.py's, shared with while_graph.
"""

from __future__ import annotations

import torch
from pydantic import Field

from orchestrate.api.config import SamplingConfig
from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import Engine, Generation
from orchestrate.techniques.rumik.cuda_graph import graphs_twice
from orchestrate.techniques.rumik.graphs import CapturedLoop, model_stop


class GraphLoopParams(TechniqueParams):
    check_every: int = Field(
        8, ge=1, le=256, description="Tokens between host checks (model length)."
    )


class ReplayLoop(CapturedLoop):
    """The `loop` slot: one replay of the captured step per token, checked every
    `check_every` tokens when the model decides the length."""

    def __init__(self, check_every: int):
        super().__init__()
        self.check_every = check_every

    def __call__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        frames: int | None,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Generation:
        vocab = engine.model.vocab
        state, cap, first, prefill_s = self.start(engine, prompt_ids, frames, sampling, generator)
        min_tokens = sampling.min_tokens_before_stop
        if frames is not None:
            graph = state.graph(engine, False, sampling, generator)
            for _ in range(cap - 1):
                graph.replay()
            tokens = state.tokens[:cap].tolist()  # the one host sync of the utterance
            return Generation(tokens, "length_policy", prefill_s)

        done, tokens = 1, [int(first.item())]
        while done < cap:
            n = min(self.check_every, cap - done)
            for k in range(n):
                allow_end = done + k >= min_tokens
                state.graph(engine, allow_end, sampling, generator).replay()
            tokens += state.tokens[done : done + n].tolist()  # one host sync per chunk
            done += n
            if vocab.end_id in tokens:
                return model_stop(tokens, state, vocab.end_id, prefill_s)
        return Generation(tokens, "token_cap", prefill_s)


class GraphLoop(Technique):
    name = "graph_loop"
    family = "rumik"
    exact = True
    slots = ("loop",)
    requires = ("cuda",)
    reduces = ("host",)  # one graph launch a step instead of a launch per kernel
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
        engine.loop = ReplayLoop(self.params.check_every)  # type: ignore[attr-defined]
