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

Every state the codec touches (MimiStream's per-row convolution tails, windowed keys and
values, positions) is read and written on one stream in launch order, resets included,
so a row reused by a new stream starts from zeros after its previous stream's last chunk.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from orchestrate.families.rumik.mimi_stream import MimiStream
from orchestrate.families.rumik.model import RumikModel


@dataclass
class CodecJob:
    rows: np.ndarray  # cache rows whose chunks this job decodes
    upto: np.ndarray  # each row's frames handed to the codec once this job is done
    audio: torch.Tensor | None = None  # [rows, samples] float32 on the host, when done
    done: torch.cuda.Event | None = None  # None: the audio is on the host already


class ChunkCodec:
    def __init__(self, model: RumikModel, rows: int, overlap: bool) -> None:
        self.vocab = model.vocab
        self.stream = MimiStream(model.codec, rows)
        self.device = self.stream.device
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if overlap and cuda else None
        self.queued: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []  # rows, upto, codes
        self.inflight: deque[CodecJob] = deque()

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
        return t.pin_memory().to(self.device, non_blocking=True)

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

    @torch.inference_mode()
    def launch(self) -> None:
        """Start decoding every queued chunk (sync: and wait for its audio)."""
        for rows, upto, codes in self.queued:
            with self._on_codec_stream():
                audio = self.stream.decode(
                    self._to_device(torch.from_numpy(rows)), self._to_device(codes)
                ).float()
                if self.side is None:
                    self.inflight.append(CodecJob(rows, upto, audio.cpu()))
                    continue
                host = audio.to("cpu", non_blocking=True)  # pinned: the copy is async
                done = torch.cuda.Event()
                done.record(self.side)
            self.inflight.append(CodecJob(rows, upto, host, done))
        self.queued.clear()

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
