"""batched_requests: the engine serves many requests at once (serving workloads only).

Fills the `server` slot with families/omnivoice/serving.py's server: the requests waiting
when a batch starts (up to `rows`) are generated together in one generate() call, each of its
own length. APPROXIMATE as `batch` is: the package draws each row's Gumbel noise in turn from
one generator, so a request's draw depends on its place in the batch (same distribution,
another random stream); a request keeps the length it has alone (tests/test_omnivoice.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from orchestrate.api.config import Workload
from orchestrate.api.technique import Technique, TechniqueParams, beyond_rows


class BatchedRequestsParams(TechniqueParams):
    rows: int = Field(32, ge=1, le=256, description="Requests generated together, at most.")


class BatchedRequests(Technique):
    name = "batched_requests"
    family = "omnivoice"
    exact = False  # another random stream per row (see above)
    slots = ("server",)
    conflicts = ("batch",)  # copies of one request: not different requests
    serves_streams = True
    summary = "serve many requests: those waiting generated together, a batch at a time"
    Params = BatchedRequestsParams

    @classmethod
    def check_workload(cls, params: TechniqueParams, workload: Workload) -> str | None:
        from orchestrate.families.omnivoice.serving import distinct_points, mixed_points

        assert isinstance(params, BatchedRequestsParams)
        if why := beyond_rows(workload, params.rows, "requests", "rows"):
            return why
        if len(points := distinct_points(workload)) > 1:
            return mixed_points(workload, len(points))
        return None

    def apply(self, engine: Any) -> None:
        rows = self.params.rows

        def build(engine: Any, workload: Workload) -> Any:
            from orchestrate.families.omnivoice.serving import BatchServer

            return BatchServer(engine, workload, rows)

        engine.server = build
