"""Continuous batching over batched_decode's rows: admit, step, hand back completed audio.

The host loop, top to bottom, for one `step()`:
  1. pick the bucket: b = the smallest batch bucket above the highest live row, s = the
     smallest context bucket above the furthest live position;
  2. replay that bucket's CUDA graph (captured in `warm_up`; eager on the CPU);
  3. read the b sampled tokens back (the one host sync per step), append them per row;
  4. a row whose token count reached its budget, or that sampled end-of-audio, is freed:
     the next `admit` prefills a waiting request into it while the other rows go on;
  5. every `chunk_frames` completed frames of a row are decoded by Mimi, batched across the
     rows that completed one this step, before the step reports those frames ready.

Codec: a streaming Mimi decode (families/rumik/mimi_stream.py) with one state row per
cache row, reset when a request takes the row: a stream's chunks decode to the audio its
whole code sequence decodes to, float rounding apart (tests/test_serving.py checks each
finished stream). With `codec=False` frames are reported ready as soon as sampled.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from orchestrate.api.config import SamplingConfig
from orchestrate.api.family import StreamRequest
from orchestrate.families.rumik.mimi_stream import MimiStream
from orchestrate.families.rumik.model import RumikModel
from orchestrate.techniques.rumik.batched_decode import BatchedDecoder


class ServingError(ValueError):
    """A request or load the server cannot take (checked before work starts)."""


ServeRequest = StreamRequest  # key, prompt ids, frames (None: the model stops it), seed


@dataclass
class StepEvent:
    key: int
    frames_ready: int  # frames of this request whose audio is ready, in total
    done: bool


# Where a server's wall time goes, each phase ended by a device sync so its seconds are the
# device's work plus the host's (a phase's GPU work is not left to land in the next one).
PHASES = {
    "prefill": "admissions: prompts written into free rows' caches (eager)",
    "step": "decode steps: graph replay (or eager step) and the sampled tokens' readback",
    "codec": "streaming Mimi decode of completed chunks and their audio's readback",
    "host": "host bookkeeping after each step (token append, stops, events), codec excluded",
}


@dataclass
class ServerStats:
    steps: int = 0
    step_rows: int = 0  # sum of bucket sizes stepped
    prefills: int = 0
    prefill_rows: int = 0
    buckets_used: set[tuple[int, int]] = field(default_factory=set)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def buckets(limit: int, small: tuple[int, ...], stride: int) -> list[int]:
    """`small` sizes below `limit`, then multiples of `stride`, ending exactly at `limit`."""
    out = [n for n in small if n < limit]
    n = stride
    while n < limit:
        if not out or n > out[-1]:
            out.append(n)
        n += stride
    return [*out, limit]


class BatchedServer:
    def __init__(
        self,
        model: RumikModel,
        rows: int,
        max_seq_len: int,
        sampling: SamplingConfig,
        *,
        graphs: bool,
        codec: bool,
        chunk_frames: int = 1,
        max_prefill_tokens: int = 4096,
        ctx_stride: int = 128,
        attention: str = "sdpa",
        keep_audio: bool = False,
        head: str = "codebook",
    ):
        self.model, self.sampling = model, sampling
        self.dec = BatchedDecoder(model, rows, max_seq_len, sampling, attention, head)
        self.per_frame = model.vocab.num_quantizers
        self.graphs_on = graphs and model.device.type == "cuda"
        self.codec_on, self.chunk_frames = codec, chunk_frames
        self.stream = MimiStream(model.codec, rows) if codec else None
        # key -> its decoded chunks, kept only when asked (tests; a server sends them on)
        self.audio: dict[int, list[np.ndarray]] | None = {} if keep_audio else None
        self.max_prefill_tokens = max_prefill_tokens
        self.batch_buckets = buckets(rows, (1, 2, 4, 8, 16, 32, 64), 64)
        # The kernel reads each row's own length: one context bucket (the whole cache) is all
        # it needs, and a bucket size's graphs are captured once, not once per context.
        self.ctx_buckets = (
            [max_seq_len] if attention == "triton" else buckets(max_seq_len, (), ctx_stride)
        )
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.stats = ServerStats()
        # Host mirror of the rows.
        self.row_key = np.full(rows, -1, dtype=np.int64)
        self.row_budget = np.zeros(rows, dtype=np.int64)
        self.row_pos = np.zeros(rows, dtype=np.int64)  # next cache position, as on the device
        self.row_count = np.zeros(rows, dtype=np.int64)  # tokens sampled by the row's request
        self.row_decoded = np.zeros(rows, dtype=np.int64)  # its frames handed to the codec
        self.row_tokens = np.zeros((rows, sampling.max_new_tokens), dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}  # finished request key -> its token ids

    def described(self) -> dict[str, str]:
        """What this server does, in words, for the record."""
        graphs = "a CUDA graph per (batch, context) bucket, captured in warm_up"
        return {
            "server": f"continuous batching over {self.rows} cache rows: a freed row takes "
            "the next waiting stream while the others decode; prefill eager, at most "
            f"{self.max_prefill_tokens} prompt tokens per admission",
            "step": graphs if self.graphs_on else "eager steps",
            "attention": "the batched decode-attention kernel, each row over its own filled "
            "positions"
            if self.dec.attention is not None
            else "SDPA over the context bucket with a per-row boolean mask",
            "head": "codebook head (APPROXIMATE: codebook step % 8 per row)"
            if self.dec.head_kind == "codebook"
            else "audio head: every audio unit and end-of-audio (stock's distribution)",
            "sampler": "top-k via Gumbel-max with hashed per-row noise (stock's top-k "
            "distribution, another random stream)",
            "codec": "streaming Mimi decode of each completed chunk, batched across streams, "
            "state carried per row"
            if self.codec_on
            else "excluded",
            "phases": "; ".join(f"{name}: {what}" for name, what in PHASES.items()),
        }

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent per phase (PHASES) since the last `clear`."""
        return dict(self.stats.seconds)

    def _synced(self, phase: str, t0: float) -> float:
        """Close `phase`, begun at `t0`, once the device has finished its work; returns now."""
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.stats.seconds[phase] += now - t0
        return now

    @property
    def rows(self) -> int:
        return self.dec.rows

    def free_rows(self) -> int:
        return int((self.row_key < 0).sum())

    def live(self) -> int:
        return self.rows - self.free_rows()

    def budget(self, req: ServeRequest) -> int:
        cap = self.sampling.max_new_tokens
        return cap if req.frames is None else min(cap, req.frames * self.per_frame)

    def check(self, req: ServeRequest) -> None:
        need = len(req.prompt_ids) + self.budget(req)
        if need > self.dec.capacity:
            raise ServingError(
                f"request {req.key} needs {need} cache positions; the server has "
                f"{self.dec.capacity}"
            )

    # ---------------------------------------------------------------- admission

    def clear(self) -> None:
        """Drop every row (a load level stopped by its time limit leaves some live)."""
        self.row_key[:] = -1
        self.dec.active.zero_()
        self.tokens.clear()
        if self.audio is not None:
            self.audio.clear()
        self.stats = ServerStats()

    @torch.inference_mode()
    def admit(self, reqs: list[ServeRequest]) -> int:
        """Prefill as many of `reqs` (in order) as there are free rows and prefill token
        budget; returns how many were admitted."""
        free = np.flatnonzero(self.row_key < 0)  # lowest rows first: keeps buckets small
        take: list[ServeRequest] = []
        tokens = 0
        for req in reqs[: len(free)]:
            self.check(req)
            tokens += len(req.prompt_ids)
            if take and tokens > self.max_prefill_tokens:
                break
            take.append(req)
        if not take:
            return 0
        t0 = time.perf_counter()
        rows = [int(r) for r in free[: len(take)]]
        self.dec.prefill(
            rows,
            [r.prompt_ids for r in take],
            [r.seed for r in take],
            [r.frames is None for r in take],
        )
        for row, req in zip(rows, take, strict=True):
            self.row_key[row] = req.key
            self.row_budget[row] = self.budget(req)
            self.row_pos[row] = len(req.prompt_ids) - 1
            self.row_count[row] = 0
            self.row_decoded[row] = 0
        if self.stream is not None:
            self.stream.reset(torch.tensor(rows))
        self._synced("prefill", t0)
        self.stats.prefills += 1
        self.stats.prefill_rows += len(take)
        return len(take)

    # ---------------------------------------------------------------- stepping

    def bucket(self) -> tuple[int, int]:
        live = np.flatnonzero(self.row_key >= 0)
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, int(live[-1]) + 1)]
        s = self.ctx_buckets[
            bisect.bisect_left(self.ctx_buckets, int(self.row_pos[live].max()) + 1)
        ]
        return b, s

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        if self.live() == 0:
            return []
        b, s = self.bucket()
        if self.graphs_on:
            graph, out = self.graphs.get((b, s)) or self._capture(b, s)
            t0 = time.perf_counter()  # a capture (outside warm_up) is not a step's time
            graph.replay()
        else:
            t0 = time.perf_counter()
            out = self.dec.step(b, s)
        sampled = out.cpu().numpy()  # the step's one host sync
        t0 = self._synced("step", t0)
        self.stats.steps += 1
        self.stats.step_rows += b
        self.stats.buckets_used.add((b, s))
        codec = self.stats.seconds["codec"]
        events = self._collect(sampled)
        self._synced("host", t0)
        self.stats.seconds["host"] -= self.stats.seconds["codec"] - codec  # timed inside
        return events

    def _collect(self, sampled: np.ndarray) -> list[StepEvent]:
        """Vectorised over rows (host time here is GPU idle time: the step has synced)."""
        b, pf = len(sampled), self.per_frame
        live = self.row_key[:b] >= 0
        self.row_pos[:b] += live
        ended = live & (sampled == self.model.vocab.end_id)
        keep = np.flatnonzero(live & ~ended)
        self.row_tokens[keep, self.row_count[keep]] = sampled[keep]
        self.row_count[keep] += 1
        count = self.row_count[:b]
        done = live & (ended | (count >= self.row_budget[:b]))
        pending = count // pf - self.row_decoded[:b]
        chunk = live & ((pending >= self.chunk_frames) | (done & (pending > 0)))
        rows = np.flatnonzero(chunk)
        if self.codec_on and len(rows):
            self._decode(rows, self.row_decoded[rows], pending[rows])
        self.row_decoded[rows] += pending[rows]
        events = [
            StepEvent(int(self.row_key[r]), int(self.row_decoded[r]), bool(done[r]))
            for r in np.flatnonzero(chunk | done)
        ]
        for r in np.flatnonzero(done):
            self.tokens[int(self.row_key[r])] = self.row_tokens[r, : count[r]].tolist()
            self.row_key[r] = -1
        if done.any():
            self.dec.active[torch.from_numpy(np.flatnonzero(done))] = 0
        return events

    def _decode(self, rows: np.ndarray, first: np.ndarray, frames: np.ndarray) -> None:
        """Stream-decode each row's pending frames, batched by chunk length; waits for the
        audio (its samples reach the host, as a server sends them)."""
        assert self.stream is not None
        t0 = time.perf_counter()
        pf = self.per_frame
        for n in np.unique(frames):
            sel = frames == n
            idx = first[sel, None] * pf + np.arange(n * pf)[None, :]
            toks = torch.from_numpy(self.row_tokens[rows[sel, None], idx])
            codes = self.model.vocab.positional_codes_rows(toks)
            audio = self.stream.decode(torch.from_numpy(rows[sel]), codes).float().cpu()
            if self.audio is not None:
                for row, chunk in zip(rows[sel], audio.numpy(), strict=True):
                    self.audio.setdefault(int(self.row_key[row]), []).append(chunk)
        self._synced("codec", t0)

    # ---------------------------------------------------------------- graphs

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Capture every (batch, context) bucket's step graph up front, so no capture lands
        inside a timed load level. Returns the number captured (0 on the CPU)."""
        if not self.graphs_on:
            return 0
        for b in self.batch_buckets:
            for s in self.ctx_buckets:
                self._capture(b, s)
        return len(self.graphs)

    def _capture(self, b: int, s: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        d = self.dec
        saved = [t.clone() for t in (d.ids, d.pos, d.count, d.out)]
        active = d.active.clone()
        d.active.zero_()  # warm-up and capture runs must not advance any live row
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                d.step(b, s)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = d.step(b, s)
        for t, v in zip((d.ids, d.pos, d.count, d.out), saved, strict=True):
            t.copy_(v)
        d.active.copy_(active)
        self.graphs[(b, s)] = (graph, out)
        return graph, out
