"""The serving server's prompt writes: a new stream's prompt into its cache row.

`padded=False` writes each admission's prompts at their own shape, eagerly. `padded=True`
writes them in chunks of at most `row_buckets[-1]` rows, each padded to the smallest
(rows, tokens) bucket that holds it (rows 1 to 32, tokens 16 to 256), so that each bucket
has one CUDA graph (`graphs=True`, captured by `capture_all` in the server's warm-up) and
a write is one replay. Padding rows write `BatchedDecoder.scratch`, a cache row no stream
owns; padded positions of a real row are overwritten by its own steps before it reads
them. A chunk with a prompt longer than every token bucket is written at its own shape.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch

from orchestrate.api.device import to_device_async
from orchestrate.techniques.rumik.batched_decode import BatchedDecoder, prompt_ids
from orchestrate.techniques.rumik.cuda_graph import warm_and_capture

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
TOKEN_BUCKETS = (16, 32, 64, 128, 256)


class PromptWriter:
    def __init__(
        self,
        dec: BatchedDecoder,
        *,
        padded: bool,
        graphs: bool,
        pool: Callable[[], Any],
    ) -> None:
        self.dec, self.padded, self.graphs_on, self.pool = dec, padded, graphs, pool
        most = min(dec.rows, ROW_BUCKETS[-1])
        self.row_buckets = [n for n in ROW_BUCKETS if n < most] + [most]
        self.token_buckets = [n for n in TOKEN_BUCKETS if n < dec.capacity]
        self.graphs: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}

    def described(self) -> str:
        if not self.padded:
            return "eagerly at the prompts' own shapes"
        how = " whose CUDA graph replays it" if self.graphs_on else " (eager)"
        return f"{self.row_buckets[-1]} rows at a time, padded to a (rows, tokens) bucket{how}"

    def write(self, rows: list[int], prompts: list[list[int]], paths: dict[str, int]) -> None:
        """Every prompt but its last token into its row's cache; `paths` counts the writes
        by how they ran: "graph", "padded" (a bucket's shapes, eager) or "eager"."""
        dev = self.dec.ids.device
        step = self.row_buckets[-1] if self.padded else len(rows)
        for i in range(0, len(rows), step):
            rs, ps = rows[i : i + step], prompts[i : i + step]
            t = max(len(p) for p in ps) - 1
            if t <= 0:
                continue
            tb = bisect.bisect_left(self.token_buckets, t)
            if not self.padded or tb == len(self.token_buckets):
                self.dec.write_prompts(self.dec.to_device(rs), prompt_ids(ps, t, dev))
                paths["eager"] = paths.get("eager", 0) + 1
                continue
            t = self.token_buckets[tb]
            nb = self.row_buckets[bisect.bisect_left(self.row_buckets, len(rs))]
            r = torch.full((nb,), self.dec.scratch, dtype=torch.long)
            r[: len(rs)] = torch.tensor(rs)
            ids = torch.zeros((nb, t), dtype=torch.long)
            ids[: len(ps)] = prompt_ids(ps, t, torch.device("cpu"))
            if self.graphs_on:
                graph, r_in, ids_in = self.graphs.get((nb, t)) or self._capture(nb, t)
                # pinned and non-blocking: a pageable copy waits for a pipelined step in flight
                r_in.copy_(to_device_async(r, dev))
                ids_in.copy_(to_device_async(ids, dev))
                graph.replay()
                paths["graph"] = paths.get("graph", 0) + 1
            else:
                self.dec.write_prompts(to_device_async(r, dev), to_device_async(ids, dev))
                paths["padded"] = paths.get("padded", 0) + 1

    def capture_all(self) -> int:
        """Every bucket's graph (none unless padded and graphed); returns how many."""
        if self.padded and self.graphs_on:
            for nb in self.row_buckets:
                for t in self.token_buckets:
                    self._capture(nb, t)
        return len(self.graphs)

    def _capture(self, nb: int, t: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """The (rows, tokens) bucket's write, captured writing only the scratch row."""
        dev = self.dec.ids.device
        rows = torch.full((nb,), self.dec.scratch, dtype=torch.long, device=dev)
        ids = torch.zeros((nb, t), dtype=torch.long, device=dev)
        graph, _ = warm_and_capture(lambda: self.dec.write_prompts(rows, ids), self.pool())
        self.graphs[(nb, t)] = (graph, rows, ids)
        return self.graphs[(nb, t)]
