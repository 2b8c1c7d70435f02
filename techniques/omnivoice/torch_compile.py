"""torch.compile of the forward slot (the write-up's stack: mode reduce-overhead).

Wraps whatever fills `forward` (stock: OmniVoice.forward). Shapes are static
(dynamic=False), so each request length gets its own graph (CUDA graph under
reduce-overhead); the first calls of a new shape compile and capture, which is why each
input shape must be warmed before timing: ov-grid's warm-ups cover every dev prompt, and
a wrapper here counts the shapes it has seen so a run can tell a cold shape was timed.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams

# Enough graphs for every (request length x row count) of a grid; past dynamo's default
# limit (8) it would silently fall back to eager.
RECOMPILE_LIMIT = 256


class TorchCompileParams(TechniqueParams):
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "reduce-overhead"
    )
    fullgraph: bool = Field(False, description="Fail instead of splitting the graph.")


def raise_recompile_limit() -> None:
    """Let dynamo keep one graph per request shape instead of silently falling back."""
    import torch._dynamo.config as dynamo_config

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, knob):
            setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), RECOMPILE_LIMIT))


def compile_forward(inner: Any, mode: str, fullgraph: bool) -> Any:
    raise_recompile_limit()
    compiled = torch.compile(inner, mode=mode, fullgraph=fullgraph, dynamic=False)
    seen: set[tuple[int, ...]] = set()

    def forward(input_ids, audio_mask, attention_mask):
        seen.add(tuple(input_ids.shape))
        if mode == "reduce-overhead":
            # Mark a step boundary so CUDA-graph outputs of the previous call may be reused.
            torch.compiler.cudagraph_mark_step_begin()
        out = compiled(input_ids, audio_mask, attention_mask)
        return out.clone() if mode == "reduce-overhead" else out

    forward.shapes_seen = seen  # type: ignore[attr-defined]
    forward.compile_mode = mode  # type: ignore[attr-defined]  # read by graph-capturing loops
    return forward


class TorchCompile(Technique):
    name = "torch_compile"
    family = "omnivoice"
    exact = True
    wraps = ("forward",)
    requires = ("cuda",)
    reduces = ("host",)  # reduce-overhead replays CUDA graphs: no launch per kernel
    summary = "torch.compile(mode=reduce-overhead) of the forward; each shape warmed first"
    Params = TorchCompileParams

    def apply(self, engine: Any) -> None:
        engine.forward = compile_forward(engine.forward, self.params.mode, self.params.fullgraph)
