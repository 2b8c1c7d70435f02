"""Batching for throughput: each request is generated as `size` copies in one batch.

The package pads the 2B CFG batch to the longest row; identical copies need no padding, so
this measures the batch's compute scaling. Audio seconds count every copy, so RTF and
audio s/s become throughput; utterances/s = size / latency. Same distribution as stock
but not exact: the package draws each item's Gumbel position noise in turn, so row 0 gets a
different random stream (with position_temperature 0 its codes equal stock's).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams


class BatchParams(TechniqueParams):
    size: int = Field(8, ge=1, le=64)


class Batch(Technique):
    name = "batch"
    family = "omnivoice"
    exact = False  # same distribution, another random stream (see above)
    slots = ("batch",)
    summary = "generate each request as N copies in one batch (throughput)"
    Params = BatchParams

    def apply(self, engine: Any) -> None:
        engine.batch = self.params.size
