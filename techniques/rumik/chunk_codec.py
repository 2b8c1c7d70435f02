"""The serving server's codec: each stream's completed chunks, decoded by streaming Mimi.

Two modes, the same audio:
  sync     each `launch` decodes the queued chunks on the current stream and waits for
           their audio on the host (a server's step reports them at once);
  overlap  (CUDA) `launch` enqueues them on a side CUDA stream and returns; their audio is
           copied to pinned host memory behind them and an event marks it there. The
           server launches a step's chunks right after the next decode step's graph, so the
           codec's kernels run while that step runs, and reports a chunk at the first step
           end after its event has completed (`finished`).
On the CPU `overlap` has no second stream: it runs as `sync` does, one step later.

A decode launches hundreds of small kernels (Mimi's transformer and SEANet, per chunk), which
cost the host more than the GPU at serving batch sizes. With `graphs` (CUDA), a decode of
`chunk_frames` frames is padded to a row bucket (1 to 64, then multiples of 64) and replayed
from that bucket's CUDA graph, captured by `capture_all` in the server's warm-up; `padded`
without graphs pads the same way, eagerly (for tests). Padding rows step MimiStream's
`scratch` state row, which no stream owns. Other chunk lengths (a stream's shorter last
chunk) decode eagerly at their own shape.

`precision` (CODEC_PRECISIONS): fp32, the decoder as Mimi ships it (cuDNN's TF32 convolutions,
float32 matmuls: SIMT kernels); tf32 (CUDA, APPROXIMATE) the same decoder with its
matmuls on tensor cores in TF32 too, the flag set around each decode and capture only;
bf16 (APPROXIMATE) a bfloat16 copy of the decoder, its state in bfloat16, its audio
returned as float32. Both change the audio by rounding: benchmarks/codec_bench.py measures
by how much (max |diff| over the peak against float32).

Every state the codec touches (MimiStream's per-row convolution tails, windowed keys and
values, positions) is read and written on one stream in launch order, resets included,
so a row reused by a new stream starts from zeros after its previous stream's last chunk.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from orchestrate.api.device import to_device_async
from orchestrate.families.rumik.mimi_stream import MimiStream
from orchestrate.families.rumik.model import RumikModel
from orchestrate.techniques.rumik.cuda_graph import ROW_BUCKETS, buckets, warm_and_capture

CODEC_PRECISIONS = ("fp32", "tf32", "bf16")


def bfloat16_copy(codec: torch.nn.Module) -> torch.nn.Module:
    """`codec` in bfloat16, the original untouched. Mimi's codebooks cache their centroids
    in a plain attribute (`_embed`, not a buffer) that `.to` leaves in float32, and a
    float32 centroid would make the first convolution's input float32: cast it too."""
    copied = copy.deepcopy(codec).to(torch.bfloat16)
    for module in copied.modules():
        if isinstance(getattr(module, "_embed", None), torch.Tensor):
            module._embed = module._embed.to(torch.bfloat16)
    return copied


@dataclass
class CodecJob:
    rows: np.ndarray  # cache rows whose chunks this job decodes
    upto: np.ndarray  # each row's frames handed to the codec once this job is done
    audio: torch.Tensor | None = None  # [rows, samples] float32 on the host, when done
    done: torch.cuda.Event | None = None  # None: the audio is on the host already


@dataclass
class CodecGraph:
    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor  # [bucket] its static inputs, filled before each replay
    codes: torch.Tensor  # [bucket, codebooks, chunk_frames]
    audio: torch.Tensor  # its output, overwritten by the next replay in the pool


class ChunkCodec:
    def __init__(
        self,
        model: RumikModel,
        rows: int,
        overlap: bool,
        *,
        chunk_frames: int = 1,
        graphs: bool = False,
        padded: bool | None = None,
        kv: str = "gather",
        attention: str = "sdpa",
        precision: str = "fp32",
    ) -> None:
        self.vocab = model.vocab
        if precision not in CODEC_PRECISIONS:
            raise ValueError(f"codec precision {precision!r}: one of {', '.join(CODEC_PRECISIONS)}")
        if precision == "tf32" and model.device.type != "cuda":
            raise ValueError("codec precision 'tf32' is a CUDA matmul mode (the CPU has none)")
        self.precision = precision
        codec = model.codec
        if precision == "bf16":  # a copy: the model's own float32 decoder stays as it is
            codec = bfloat16_copy(codec)
        ring_attention = None
        if attention == "triton":  # each row's ring read in place (CUDA; kv ring)
            from orchestrate.techniques.rumik.kernels.ring_attention import ring_attention
        elif attention != "sdpa":
            raise ValueError(f"codec attention {attention!r}: one of sdpa, triton")
        self.stream = MimiStream(
            codec, rows, kv=kv, max_frames=chunk_frames, ring_attention=ring_attention
        )
        self.device = self.stream.device
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if overlap and cuda else None
        self.queued: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []  # rows, upto, codes
        self.inflight: deque[CodecJob] = deque()
        self.chunk_frames = chunk_frames
        self.graphs_on = graphs and cuda
        self.padded = self.graphs_on if padded is None else padded
        self.row_buckets = buckets(rows, ROW_BUCKETS, 64)
        self.graphs: dict[int, CodecGraph] = {}

    def described(self) -> str:
        precision = {
            "fp32": "float32 (TF32 convolutions)",
            "tf32": "float32 with TF32 convolutions and matmuls (APPROXIMATE)",
            "bf16": "a bfloat16 copy of the decoder (APPROXIMATE)",
        }[self.precision]
        if not self.padded:
            return f"each chunk length's rows decoded together, eagerly, {precision}"
        how = "its CUDA graph replayed" if self.graphs_on else "eagerly"
        return (
            f"{self.chunk_frames}-frame chunks padded to a row bucket "
            f"({self.row_buckets[0]} to {self.row_buckets[-1]}), {how}, {precision}"
        )

    @contextlib.contextmanager
    def _matmul_mode(self) -> Iterator[None]:
        """TF32 matmuls for the codec's launches (and captures) only: the flag is read on
        the host as each kernel is chosen, so the decode steps around it keep theirs."""
        if self.precision != "tf32":
            yield
            return
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    @contextlib.contextmanager
    def _on_codec_stream(self) -> Iterator[None]:
        if self.side is None:
            yield
        else:
            with torch.cuda.stream(self.side):
                yield

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor onto the device without the host waiting for the codec stream (a
        pageable copy would: it is ordered behind the chunks launched before it)."""
        if self.side is None:
            return t.to(self.device)
        return to_device_async(t, self.device)

    def reset(self, rows: list[int]) -> None:
        """New streams take these rows: zero their history (ordered after their last
        stream's chunks)."""
        with self._on_codec_stream():
            self.stream.reset(self._to_device(torch.tensor(rows)))

    def put(
        self, rows: np.ndarray, first: np.ndarray, frames: np.ndarray, tokens: np.ndarray
    ) -> None:
        """Queue each row's `frames[i]` frames from frame `first[i]` of its `tokens` row."""
        pf = self.vocab.num_quantizers
        for n in np.unique(frames):  # one decode per chunk length
            sel = frames == n
            idx = first[sel, None] * pf + np.arange(n * pf)[None, :]
            toks = torch.from_numpy(tokens[rows[sel, None], idx])
            codes = self.vocab.positional_codes_rows(toks)
            self.queued.append((rows[sel], first[sel] + n, codes))

    def _merged(self) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor]]:
        """The queue as few decodes as it can be: chunks of one length from different rows
        (put by different steps) decode together. A row queued twice keeps its chunks in
        order, in separate decodes (its second reads the state its first leaves)."""
        out: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        for rows, upto, codes in self.queued:
            for k, (r, u, c) in enumerate(out):
                if c.shape[-1] == codes.shape[-1] and not np.intersect1d(r, rows).size:
                    out[k] = (np.concatenate([r, rows]), np.concatenate([u, upto]),
                              torch.cat([c, codes]))  # fmt: skip
                    break
            else:
                out.append((rows, upto, codes))
        return out

    @torch.inference_mode()
    def launch(self, paths: dict[str, int]) -> None:
        """Start decoding every queued chunk (sync: and wait for its audio); `paths` counts
        the decodes by how they ran: "graph", "padded" (a bucket's shapes, eager), "eager"."""
        for rows, upto, codes in self._merged():
            with self._on_codec_stream(), self._matmul_mode():
                audio, how = self._decode(rows, codes)
                paths[how] = paths.get(how, 0) + 1
                audio = audio.float()
                if self.side is None:
                    self.inflight.append(CodecJob(rows, upto, audio.cpu()))
                    continue
                host = audio.to("cpu", non_blocking=True)  # pinned: the copy is async
                done = torch.cuda.Event()
                done.record(self.side)
            self.inflight.append(CodecJob(rows, upto, host, done))
        self.queued.clear()

    def _decode(self, rows: np.ndarray, codes: torch.Tensor) -> tuple[torch.Tensor, str]:
        """Audio [len(rows), ...] of each row's chunk, and how it ran (`launch`)."""
        n = len(rows)
        if not self.padded or codes.shape[-1] != self.chunk_frames:
            at = self._to_device(torch.from_numpy(rows))
            return self.stream.decode(at, self._to_device(codes)), "eager"
        nb = self.row_buckets[bisect.bisect_left(self.row_buckets, n)]
        padded_rows = torch.full((nb,), self.stream.scratch, dtype=torch.long)
        padded_rows[:n] = torch.from_numpy(rows)
        padded_codes = codes.new_zeros((nb, *codes.shape[1:]))
        padded_codes[:n] = codes
        if not self.graphs_on:
            out = self.stream.decode(padded_rows.to(self.device), padded_codes.to(self.device))
            return out[:n], "padded"
        g = self.graphs.get(nb) or self._capture(nb)
        g.rows.copy_(self._to_device(padded_rows))
        g.codes.copy_(self._to_device(padded_codes))
        g.graph.replay()  # on the current stream: the codec's
        return g.audio[:n], "graph"

    @torch.inference_mode()
    def decode_now(self, rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The next frames of `rows` as float32 audio, eagerly, on the current stream, at
        this codec's precision (no queue, no graph: for measuring what precision changes)."""
        with self._matmul_mode():
            return self.stream.decode(rows.to(self.device), codes.to(self.device)).float()

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Every row bucket's decode graph (none unless graphed); returns how many."""
        if self.graphs_on:
            for nb in self.row_buckets:
                if nb not in self.graphs:
                    self._capture(nb)
        return len(self.graphs)

    def _capture(self, nb: int) -> CodecGraph:
        """Bucket `nb`'s decode, warmed up and captured stepping only the scratch row, in
        the codec's own memory pool (its replays overlap the server's step graphs')."""
        rows = torch.full((nb,), self.stream.scratch, dtype=torch.long, device=self.device)
        shape = (nb, self.vocab.num_quantizers, self.chunk_frames)
        codes = torch.zeros(shape, dtype=torch.long, device=self.device)
        pool = next(iter(self.graphs.values())).graph.pool() if self.graphs else None
        with self._matmul_mode():
            graph, audio = warm_and_capture(lambda: self.stream.decode(rows, codes), pool)
        self.graphs[nb] = CodecGraph(graph, rows, codes, audio)
        return self.graphs[nb]

    def finished(self) -> list[CodecJob]:
        """The launched jobs whose audio has reached the host, in launch order."""
        out = []
        while self.inflight and (self.inflight[0].done is None or self.inflight[0].done.query()):
            out.append(self.inflight.popleft())
        return out

    def wait(self) -> None:
        """Block until every launched chunk's audio is on the host."""
        if self.side is not None:
            self.side.synchronize()

    def clear(self) -> None:
        """Drop queued and launched work (a level stopped by its time limit)."""
        self.wait()
        self.queued.clear()
        self.inflight.clear()
