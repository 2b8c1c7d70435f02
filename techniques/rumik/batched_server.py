"""Continuous batching over batched_decode's rows: admit, step, hand back completed audio.

The host loop, top to bottom, for one `step()`:
  1. pick the bucket: b = the smallest batch bucket above the highest live row, s = the
     smallest context bucket above the furthest live position;
  2. replay that bucket's CUDA graph (captured in `warm_up`; eager on the CPU);
  3. read the b sampled tokens back (the one host sync per step), append them per row;
  4. a row whose token count reached its budget, or that sampled end-of-audio, is freed:
     the next `admit` prefills a waiting request into it while the other rows go on
     (`chunk_tokens`: its prompt rides along the next steps, at most that many prompt
     tokens a step, oldest admission first; armed once its last chunk is written);
  5. every `chunk_frames` completed frames of a row go to the codec (chunk_codec.py),
     batched across the rows that completed one this step; a step reports frames ready
     once their audio is on the host. `codec_overlap=False`: decoded before the step
     returns; True: launched on a side CUDA stream behind the next step's graph, so the
     codec runs while that step runs, and reported at the first step end after it is done.
     A row that sampled its last token stops decoding at once and is freed (taken by the
     next request) only when its last chunk's audio is ready. Where steps are graphed, a
     decode is padded to a row bucket and replayed from that bucket's graph as well.

Codec: a streaming Mimi decode (families/rumik/mimi_stream.py) with one state row per
cache row, reset when a request takes the row: a stream's chunks decode to the audio its
whole code sequence decodes to, float rounding apart (tests/test_serving.py checks each
finished stream, in both modes). With `codec=False` frames are reported ready as soon as
sampled.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from orchestrate.api.config import SamplingConfig
from orchestrate.api.family import StreamRequest
from orchestrate.api.parking import Parked, parked
from orchestrate.families.rumik.engine import Projections
from orchestrate.families.rumik.model import RumikModel
from orchestrate.techniques.rumik.batched_decode import BatchedDecoder
from orchestrate.techniques.rumik.chunk_codec import ChunkCodec
from orchestrate.techniques.rumik.cuda_graph import ROW_BUCKETS, buckets, warm_and_capture
from orchestrate.techniques.rumik.prompt_writes import PromptWriter

# Chunked prefill's chunk buckets (tokens a step carries), up to the server's chunk_tokens.
CHUNK_BUCKETS = (32, 64, 128, 256, 512, 1024)


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
    "prefill": "admissions: prompts written into free rows' caches and the rows armed "
    "(chunked prefill: admissions, staging each step's chunk and arming; the chunks' GPU "
    "work is in the step)",
    "step": "decode steps: graph replay (or eager step) and the sampled tokens' readback "
    "(with codec overlap: the codec's kernels running beside it included, their launch not)",
    "codec": "streaming Mimi decode of completed chunks and their audio's readback",
    "codec_launch": "codec overlap: host time launching chunks' decode on the codec stream "
    "(their GPU time overlaps the step)",
    "codec_wait": "codec overlap: waiting for chunks' audio with no decode step to overlap",
    "host": "host bookkeeping after each step (token append, stops, events), codec excluded",
}
SYNC_PHASES = ("prefill", "step", "codec", "host")
OVERLAP_PHASES = ("prefill", "step", "codec_launch", "codec_wait", "host")


@dataclass
class Prefilling:
    """A row whose prompt goes in by chunks (chunked prefill): its request and how many of
    the prompt's tokens (all but the last) are written."""

    row: int
    req: ServeRequest
    written: int = 0

    @property
    def todo(self) -> int:
        return len(self.req.prompt_ids) - 1 - self.written


@dataclass
class Launched:
    """A launched decode step, until `step` reads it back: its sampled tokens' buffer on the
    device, each of its rows' request key and whether the row was sampling at launch, the
    prefilling rows its chunk completed and when it was launched (`perf_counter`)."""

    out: torch.Tensor
    keys: np.ndarray
    sampling: np.ndarray
    prefilled: list[Prefilling]
    t0: float


@dataclass
class ServerStats:
    steps: int = 0
    step_rows: int = 0  # sum of bucket sizes stepped
    prefills: int = 0
    prefill_rows: int = 0
    # prompt writes by path: "graph" (a bucket's CUDA graph), "padded" (a bucket's shapes,
    # eager), "eager" (the prompts' own shapes: no padding, or longer than every bucket)
    prefill_writes: dict[str, int] = field(default_factory=dict)
    chunk_tokens: int = 0  # chunked prefill: prompt tokens carried by steps
    chunk_padding: int = 0  # and the padding tokens their buckets added
    codec_decodes: dict[str, int] = field(default_factory=dict)  # by path, as prefill_writes
    buckets_used: set[tuple[int, int]] = field(default_factory=set)
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds (PHASES)


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
        codec_overlap: bool = False,
        pad_prefill: bool | None = None,
        pad_codec: bool | None = None,
        codec_kv: str = "gather",
        codec_attention: str = "sdpa",
        codec_precision: str = "fp32",
        admit_every: int = 1,
        codec_every: int = 1,
        projections: Projections | None = None,
        kv: str = "model",
        glue: str = "torch",
        chunk_tokens: int = 0,
        pipeline: bool = False,
        attention_block: int | None = None,  # BatchedDecoder's default for the cache
        attention_splits: int | str = "auto",
    ):
        self.model, self.sampling = model, sampling
        # Pipelined steps: the next step is launched as soon as a step's tokens are read
        # back, and the host handles those tokens (and the driver its events and arrivals)
        # while it runs. A row that finished in one step draws one more token in the next,
        # dropped; a row armed after a step first samples two steps on. A synchronous codec
        # would wait for the step in flight, so pipelining needs the codec overlapped.
        if pipeline and codec and not codec_overlap:
            raise ServingError("pipeline needs codec_overlap (a synchronous codec waits for "
                               "the step in flight)")  # fmt: skip
        self.pipeline = pipeline
        self.inflight: Launched | None = None
        self._parked: Parked | None = None  # while `parked`: what left the device
        self.dec = BatchedDecoder(
            model, rows, max_seq_len, sampling, attention, head, projections=projections, kv=kv,
            glue=glue, chunk_tokens=chunk_tokens, attention_block=attention_block,
            attention_splits=attention_splits,
        )  # fmt: skip
        # Chunked prefill: prompts ride along steps, at most chunk_tokens tokens a step,
        # padded to a bucket (a graph per (batch, context, chunk) bucket); `pending` holds
        # the admitted rows whose prompts are not yet all written, oldest first.
        self.chunk_buckets = [n for n in CHUNK_BUCKETS if n < chunk_tokens] + (
            [chunk_tokens] if chunk_tokens else []
        )
        self.pending: deque[Prefilling] = deque()
        self.per_frame = model.vocab.num_quantizers
        self.graphs_on = graphs and model.device.type == "cuda"
        self.chunk_frames = chunk_frames
        self.codec = (
            ChunkCodec(
                model,
                rows,
                codec_overlap,
                chunk_frames=chunk_frames,
                graphs=self.graphs_on,
                padded=pad_codec,
                kv=codec_kv,
                attention=codec_attention,
                precision=codec_precision,
            )
            if codec
            else None
        )
        self.overlap = codec and codec_overlap
        self.phases = OVERLAP_PHASES if self.overlap else SYNC_PHASES
        # key -> its decoded chunks, kept only when asked (tests; a server sends them on)
        self.audio: dict[int, list[np.ndarray]] | None = {} if keep_audio else None
        self.max_prefill_tokens = max_prefill_tokens
        # Admissions at most every `admit_every` decode steps while others decode: each
        # prefill reads every weight once, however few prompts it writes, so gathering
        # arrivals trades up to that many steps of first-audio latency for fewer reads.
        if admit_every < 1:
            raise ServingError(f"admit_every must be at least 1 (got {admit_every})")
        self.admit_every, self.last_admit_step = admit_every, -admit_every
        # The codec launched every `codec_every` steps, the chunks completed meanwhile
        # decoded together: a decode of up to 64 rows costs about the same (its kernels'
        # launches and latency, not its rows), so fewer, fuller decodes cost the GPU less;
        # each chunk's audio is at most codec_every - 1 steps later. With no step to run,
        # the queue is always launched (nothing is left waiting).
        if codec_every < 1:
            raise ServingError(f"codec_every must be at least 1 (got {codec_every})")
        self.codec_every = codec_every
        self.batch_buckets = buckets(rows, ROW_BUCKETS, 64)
        # The kernel reads each row's own length: one context bucket (the whole cache) is all
        # it needs, and a bucket size's graphs are captured once, not once per context.
        self.ctx_buckets = (
            [max_seq_len] if attention == "triton" else buckets(max_seq_len, (), ctx_stride)
        )
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Padded prompt writes by default where decode steps are graphed (padded eagerly
        # elsewhere only for tests): prompt_writes.py.
        self.prompts = PromptWriter(
            self.dec,
            padded=self.graphs_on if pad_prefill is None else pad_prefill,
            graphs=self.graphs_on,
            pool=self._pool,
        )
        self.stats = ServerStats(seconds=dict.fromkeys(self.phases, 0.0))
        # Host mirror of the rows.
        self.row_key = np.full(rows, -1, dtype=np.int64)
        self.row_budget = np.zeros(rows, dtype=np.int64)
        self.row_pos = np.zeros(rows, dtype=np.int64)  # next cache position, as on the device
        self.row_count = np.zeros(rows, dtype=np.int64)  # tokens sampled by the row's request
        self.row_decoded = np.zeros(rows, dtype=np.int64)  # its frames handed to the codec
        self.row_ready = np.zeros(rows, dtype=np.int64)  # its frames whose audio is ready
        self.row_finishing = np.zeros(rows, dtype=bool)  # sampled its last; audio pending
        self.row_prefilling = np.zeros(rows, dtype=bool)  # chunked: its prompt not all written
        self.row_tokens = np.zeros((rows, sampling.max_new_tokens), dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}  # finished request key -> its token ids

    def described(self) -> dict[str, str]:
        """What this server does, in words, for the record."""
        graphs = "a CUDA graph per (batch, context) bucket, captured in warm_up"
        return {
            "server": f"continuous batching over {self.rows} cache rows: a freed row takes "
            "the next waiting stream while the others decode; "
            + (
                f"admissions at most every {self.admit_every} steps, "
                if self.admit_every > 1
                else ""
            )
            + "at most "
            f"{self.max_prefill_tokens} prompt tokens per admission, written "
            + (
                f"by chunks of at most {self.dec.chunk_tokens} tokens riding along decode "
                f"steps (padded to {', '.join(map(str, self.chunk_buckets))})"
                if self.dec.chunk_tokens
                else self.prompts.described()
            ),
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
            "state carried per row, "
            + self.codec.described()
            + ("; launched on a side CUDA stream behind the next step" if self.overlap else "")
            + (
                f"; launched every {self.codec_every} steps, the chunks completed meanwhile "
                "decoded together"
                if self.codec_every > 1
                else ""
            )
            if self.codec is not None
            else "excluded",
            "phases": "; ".join(f"{name}: {PHASES[name]}" for name in self.phases)
            + (
                "; pipelined: each phase is host time while the GPU runs the next step, "
                "step the wait for a step's tokens"
                if self.pipeline
                else ""
            ),
        }

    def memory(self) -> dict[str, int]:
        """Bytes held on the device, by what they are (BatchedDecoder.memory); while
        `parked`, `weights_parked`: the unread weights' bytes moved to host memory, and on
        CUDA `parked_freed`: the allocator's measured drop when they left."""
        held = self.dec.memory()
        if self._parked is not None:
            held["weights_parked"] = self._parked.bytes
            if self._parked.freed is not None:
                held["parked_freed"] = self._parked.freed
        return held

    @contextmanager
    def parked(self) -> Iterator[Parked]:
        """The model's weights this server never reads, off the device while it serves and
        put back after (api/parking.py): the issue's "a stack keeps in GPU memory only what
        it reads" (FP8 projections leave 5.62 GB of bf16 originals unread)."""
        with parked(self.dec.unread_parameters()) as record:
            self._parked = record
            try:
                yield record
            finally:
                self._parked = None

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent per phase (PHASES) since the last `clear`."""
        return dict(self.stats.seconds)

    def _synced(self, phase: str, t0: float, sync: bool = True) -> float:
        """Close `phase`, begun at `t0`, once the device has finished its work on this
        stream (not the codec's side stream, whose work overlaps); returns now. `sync=False`
        where the phase ended in a blocking readback already."""
        if sync and self.model.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
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

    def decoding(self) -> tuple[int, int]:
        """(rows sampling, cache positions their next step's attention reads: each row's
        position + 1), from the host mirror: no device sync."""
        rows = self._sampling()
        return int(rows.sum()), int((self.row_pos[rows] + 1).sum())

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
        if self.inflight is not None:  # its tokens are nobody's now
            self.inflight.out.cpu()
            self.inflight = None
        self.row_key[:] = -1
        self.row_finishing[:] = False
        self.row_prefilling[:] = False
        self.pending.clear()
        self.dec.active.zero_()
        if self.codec is not None:
            self.codec.clear()
        self.tokens.clear()
        if self.audio is not None:
            self.audio.clear()
        self.stats = ServerStats(seconds=dict.fromkeys(self.phases, 0.0))
        self.last_admit_step = -self.admit_every

    @torch.inference_mode()
    def admit(self, reqs: list[ServeRequest]) -> int:
        """Prefill as many of `reqs` (in order) as there are free rows and prefill token
        budget; returns how many were admitted."""
        paced = self.stats.steps - self.last_admit_step < self.admit_every
        if paced and self.live():  # gather arrivals (an idle server admits at once)
            return 0
        free = np.flatnonzero(self.row_key < 0)  # lowest rows first: keeps buckets small
        take: list[ServeRequest] = []
        tokens = sum(p.todo for p in self.pending)  # chunked: still to write
        for req in reqs[: len(free)]:
            self.check(req)
            tokens += len(req.prompt_ids)
            if (take or self.pending) and tokens > self.max_prefill_tokens:
                break
            take.append(req)
        if not take:
            return 0
        t0 = time.perf_counter()
        rows = [int(r) for r in free[: len(take)]]
        prompts = [r.prompt_ids for r in take]
        if self.dec.chunk_tokens:  # written by the next steps, armed after the last chunk
            self.dec.hold(rows)
            for row, req in zip(rows, take, strict=True):
                self.pending.append(Prefilling(row, req))
            self.row_prefilling[rows] = True
        else:
            self.prompts.write(rows, prompts, self.stats.prefill_writes)
            self.dec.arm(rows, prompts, [r.seed for r in take], [r.frames is None for r in take])
        for row, req in zip(rows, take, strict=True):
            self.row_key[row] = req.key
            self.row_budget[row] = self.budget(req)
            self.row_pos[row] = len(req.prompt_ids) - 1
            self.row_count[row] = 0
            self.row_decoded[row] = 0
            self.row_ready[row] = 0
        if self.codec is not None:
            self.codec.reset(rows)
        self._synced("prefill", t0, sync=not self.pipeline)
        self.last_admit_step = self.stats.steps
        self.stats.prefills += 1
        self.stats.prefill_rows += len(take)
        return len(take)

    # ---------------------------------------------------------------- stepping

    def bucket(self) -> tuple[int, int]:
        live = np.flatnonzero(self.row_key >= 0)
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, int(live[-1]) + 1)]
        # pipelined, the host's positions lag the device's by the step in flight
        furthest = min(int(self.row_pos[live].max()) + 1 + self.pipeline, self.dec.capacity)
        s = self.ctx_buckets[bisect.bisect_left(self.ctx_buckets, furthest)]
        return b, s

    def _stage_chunk(self) -> tuple[int, list[Prefilling]]:
        """Chunked prefill: the next prompt tokens (oldest admission first, at most
        chunk_tokens) staged for the coming step; returns its chunk bucket (0: none) and
        the rows whose prompts that chunk completes, taken off the queue."""
        rows: list[int] = []
        positions: list[int] = []
        ids: list[int] = []
        completes: list[Prefilling] = []
        room = self.dec.chunk_tokens
        while self.pending and len(ids) < room:
            head = self.pending[0]
            start = head.written
            end = start + min(head.todo, room - len(ids))
            rows += [head.row] * (end - start)
            positions += range(start, end)
            ids += head.req.prompt_ids[start:end]
            head.written = end
            if head.todo:  # the chunk is full; the rest goes in the next
                break
            completes.append(self.pending.popleft())
        if not ids:  # one-token prompts: nothing to write
            return 0, completes
        c = self.chunk_buckets[bisect.bisect_left(self.chunk_buckets, len(ids))]
        self.dec.stage_chunk(rows, positions, ids, c)
        self.stats.prefill_writes["chunk"] = self.stats.prefill_writes.get("chunk", 0) + 1
        self.stats.chunk_tokens += len(ids)
        self.stats.chunk_padding += c - len(ids)
        return c, completes

    def _arm_prefilled(self, done: list[Prefilling]) -> None:
        """Chunked prefill: arm the rows whose prompts are written (their next step reads
        the last prompt token)."""
        rows, reqs = [p.row for p in done], [p.req for p in done]
        self.dec.arm(rows, [r.prompt_ids for r in reqs], [r.seed for r in reqs],
                     [r.frames is None for r in reqs])  # fmt: skip
        self.row_prefilling[rows] = False

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One decode step over the rows still sampling (none: only the codec's pending
        chunks), then the events of rows whose audio became ready or that finished.
        Pipelined, the step read back here is the one launched by the call before, and the
        next one is launched before this one's tokens are handled."""
        if self.live() == 0 and self.inflight is None:
            return []
        step = None
        if self.pipeline:
            step = self.inflight or (self._launch() if self._has_work() else None)
            self.inflight = None
        elif self._has_work():
            step = self._launch()
        sampled = None
        if step is not None:
            if self.overlap and not self.pipeline and self._codec_due(True):  # while it runs
                step.t0 += self._launch_codec()
            if self.pipeline:  # its phase is the wait alone: the host worked meanwhile
                step.t0 = time.perf_counter()
            # the step's one host sync; a copy, as the next step reuses `out` (on the CPU
            # .cpu() returns the buffer itself)
            sampled = step.out.cpu().numpy().copy()
            self._synced("step", step.t0, sync=False)
            if self.pipeline and self._has_work(ahead=1):  # it runs while we go on
                self.inflight = self._launch()
        elif self.codec is not None and self.overlap:  # nothing to overlap: launch and wait
            t0 = time.perf_counter()
            launch = self._launch_codec()
            self.codec.wait()
            self.stats.seconds["codec_wait"] += time.perf_counter() - t0 - launch
        t0 = time.perf_counter()
        chunked = np.empty(0, np.int64)
        if step is not None:
            assert sampled is not None
            chunked = self._collect(sampled, step)
            if step.prefilled:  # armed after _collect: this step sampled nothing for them
                t1 = time.perf_counter()
                self._arm_prefilled(step.prefilled)
                self._synced("prefill", t1, sync=not self.pipeline)
                t0 += time.perf_counter() - t1
        if self.pipeline and self.overlap and self._codec_due(step is not None):  # beside next
            t0 += self._launch_codec()
        if self.codec is not None and not self.overlap and self._codec_due(step is not None):
            t1 = time.perf_counter()
            self.codec.launch(self.stats.codec_decodes)  # and waits for the audio
            self._synced("codec", t1)
            t0 += time.perf_counter() - t1  # host time is the rest
        events = self._report(chunked)
        self._synced("host", t0, sync=not self.pipeline)
        if self.inflight is not None and self.live() == 0:  # a stream ended on its own:
            t0 = time.perf_counter()  # the step launched for it has no one to serve
            self.inflight.out.cpu()
            self.inflight = None
            self._synced("step", t0, sync=False)
        return events

    def _sampling(self) -> np.ndarray:
        """Each row: taken by a stream that is still sampling (its prompt written, its last
        token not yet drawn)."""
        return (self.row_key >= 0) & ~self.row_finishing & ~self.row_prefilling

    def _has_work(self, ahead: int = 0) -> bool:
        """A row still sampling after `ahead` more tokens (pipelined: 1, the step read back
        but not yet handled: a row it takes to its budget needs no next step), or a prompt
        still to write (chunked prefill)."""
        sampling = self._sampling() & (self.row_count + ahead < self.row_budget)
        return bool(sampling.any()) or bool(self.pending)

    def _launch(self) -> Launched:
        """Stage the next prompt chunk (if any) and launch a step over the bucket of the
        rows live now; its tokens are read back by `step`."""
        b, s = self.bucket()
        c, completes = 0, []
        if self.pending:
            t0 = time.perf_counter()
            c, completes = self._stage_chunk()
            self._synced("prefill", t0, sync=False)  # a host copy: nothing left to wait for
        sampling = self._sampling()[:b]
        if self.graphs_on:
            graph, out = self.graphs.get((b, s, c)) or self._capture(b, s, c)
            t0 = time.perf_counter()  # a capture (outside warm_up) is not a step's time
            graph.replay()
        else:
            t0 = time.perf_counter()
            out = self.dec.step(b, s, c)
        self.stats.steps += 1
        self.stats.step_rows += b
        self.stats.buckets_used.add((b, s))
        return Launched(out, self.row_key[:b].copy(), sampling, completes, t0)

    def _codec_due(self, stepped: bool) -> bool:
        """Whether the codec launches now: every `codec_every` steps, and whenever no step
        ran (the queue must not wait for steps that may not come)."""
        if self.codec is None:
            return False
        return not stepped or self.stats.steps % self.codec_every == 0

    def _launch_codec(self) -> float:
        """Start the queued chunks on the codec's stream; returns the host seconds it took."""
        assert self.codec is not None
        t0 = time.perf_counter()
        self.codec.launch(self.stats.codec_decodes)
        spent = time.perf_counter() - t0
        self.stats.seconds["codec_launch"] += spent
        return spent

    def _collect(self, sampled: np.ndarray, step: Launched) -> np.ndarray:
        """Append the sampled tokens, hand completed chunks to the codec, mark the rows that
        finished sampling; returns the rows that completed a chunk. Vectorised over rows
        (host time here is GPU idle time unless pipelined). A row counts only if it was
        sampling when the step launched, for the same request, and still is (pipelined:
        a row that finished in the step before drew one more token, dropped here)."""
        b, pf = len(sampled), self.per_frame
        live = self._sampling()[:b] & step.sampling & (self.row_key[:b] == step.keys)
        self.row_pos[:b] += live
        ended = live & (sampled == self.model.vocab.end_id)
        keep = np.flatnonzero(live & ~ended)
        self.row_tokens[keep, self.row_count[keep]] = sampled[keep]
        self.row_count[keep] += 1
        count = self.row_count[:b]
        done = live & (ended | (count >= self.row_budget[:b]))
        pending = count // pf - self.row_decoded[:b]
        rows = np.flatnonzero(live & ((pending >= self.chunk_frames) | (done & (pending > 0))))
        if self.codec is not None and len(rows):
            self.codec.put(rows, self.row_decoded[rows], pending[rows], self.row_tokens)
        self.row_decoded[rows] += pending[rows]
        if self.codec is None:
            self.row_ready[rows] = self.row_decoded[rows]
        finished = np.flatnonzero(done)
        for r in finished:
            self.tokens[int(self.row_key[r])] = self.row_tokens[r, : count[r]].tolist()
        self.row_finishing[finished] = True
        if len(finished):
            self.dec.deactivate(finished.tolist())
        return rows

    def _report(self, chunked: np.ndarray) -> list[StepEvent]:
        """Events for the rows whose audio became ready (without a codec: the rows that
        completed a chunk this step) and for the rows freed: those that finished sampling
        and whose every frame's audio is ready."""
        changed: set[int] = set()
        if self.codec is None:
            changed.update(int(r) for r in chunked)
        else:
            for job in self.codec.finished():
                self.row_ready[job.rows] = job.upto
                changed.update(int(r) for r in job.rows)
                if self.audio is not None:
                    assert job.audio is not None
                    for row, chunk in zip(job.rows, job.audio.numpy(), strict=True):
                        self.audio.setdefault(int(self.row_key[row]), []).append(chunk)
        free = {
            int(r)
            for r in np.flatnonzero(self.row_finishing & (self.row_ready == self.row_decoded))
        }
        events = [
            StepEvent(int(self.row_key[r]), int(self.row_ready[r]), r in free)
            for r in sorted(changed | free)
        ]
        free = np.array(sorted(free), dtype=np.int64)
        self.row_key[free] = -1
        self.row_finishing[free] = False
        return events

    # ---------------------------------------------------------------- graphs

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Capture every (batch, context) bucket's step graph, the prompt writes' and the
        codec's up front, so no capture lands inside a timed load level. Returns the number
        captured (0 on the CPU)."""
        if not self.graphs_on:
            return 0
        for b in self.batch_buckets:
            for s in self.ctx_buckets:
                for c in [0, *self.chunk_buckets]:
                    self._capture(b, s, c)
        codec = self.codec.capture_all() if self.codec is not None else 0
        writes = 0 if self.dec.chunk_tokens else self.prompts.capture_all()
        return len(self.graphs) + writes + codec

    def _pool(self) -> Any:
        """The memory pool every graph of this server shares (graphs replay one at a time;
        the only tensors outliving a replay are the step graphs' outputs, kept alive)."""
        first = next(iter(self.graphs.values()), None) or next(
            iter(self.prompts.graphs.values()), None
        )
        return None if first is None else first[0].pool()

    def _capture(self, b: int, s: int, c: int = 0) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The (batch, context, chunk) bucket's step graph. Its warm-up runs write the
        staged chunk's keys (the same values the step will write) and advance no row."""
        d = self.dec
        saved = [t.clone() for t in (d.ids, d.pos, d.count, d.out)]
        active = d.active.clone()
        d.active.zero_()  # warm-up and capture runs must not advance any live row
        graph, out = warm_and_capture(lambda: d.step(b, s, c), self._pool())
        for t, v in zip((d.ids, d.pos, d.count, d.out), saved, strict=True):
            t.copy_(v)
        d.active.copy_(active)
        self.graphs[(b, s, c)] = (graph, out)
        return graph, out
