"""Baseline B for serving (issue 34): transformers generate() with a static cache over one
static batch, every stream arriving together.

What a deployer gets without a serving engine: the prompts go in as one batch, the batch
decodes in lockstep until the longest stream is done, and nothing joins until then. A
streamer (transformers' BaseStreamer) sees each step's tokens as generate() produces them,
so frames are timestamped as they complete and Mimi decodes each chunk the same way the
batched server does (streaming, each stream's codec state carried: mimi_stream.py). The streamer's
`.cpu()` of every step's tokens is generate()'s own code: one host copy per step, which
generate() without a streamer would not make.

One StaticCache per batch size, reused: `warm_up` runs a short generate() on it so
transformers' automatic torch.compile of the decode step (CUDA only) happens outside the
timed call. Same prompt length for every stream (no padding), random-weight length policy
(end-of-audio masked), same sampling settings; its tokens come from transformers' sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import LogitsProcessorList, StaticCache
from transformers.generation.streamers import BaseStreamer

from orchestrate.api.config import SamplingConfig
from orchestrate.families.rumik.engine import cache_arg
from orchestrate.families.rumik.mimi_stream import MimiStream
from orchestrate.families.rumik.model import RumikModel
from orchestrate.techniques.rumik.hf_loop import AudioOnly


class _FrameClock(BaseStreamer):
    """Timestamps every completed chunk of the batch (after its codec decode)."""

    def __init__(self, model: RumikModel, chunk_frames: int, stream: MimiStream | None, t0: float):
        self.model, self.chunk_frames, self.stream, self.t0 = model, chunk_frames, stream, t0
        self.per_frame = model.vocab.num_quantizers
        self.prompt_seen = False
        self.steps: list[torch.Tensor] = []  # [B] token ids per step
        self.decoded = 0  # frames decoded (all rows advance together)
        self.ready_s: list[float] = []  # per frame

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        self.steps.append(value.reshape(-1))
        if len(self.steps) % (self.per_frame * self.chunk_frames) == 0:
            self._flush()

    def end(self) -> None:
        self._flush()

    def _flush(self) -> None:
        frames = len(self.steps) // self.per_frame
        if frames <= self.decoded:
            return
        if self.stream is not None:
            a, b = self.decoded * self.per_frame, frames * self.per_frame
            toks = torch.stack(self.steps[a:b], dim=1)  # [B, tokens]
            codes = self.model.vocab.positional_codes_rows(toks)
            self.stream.decode(torch.arange(len(toks)), codes).float().cpu()
        now = time.perf_counter() - self.t0
        self.ready_s.extend([now] * (frames - self.decoded))
        self.decoded = frames


class StaticBatchBaseline:
    def __init__(self, model: RumikModel, batch: int, prompt_len: int, tokens: int):
        self.model, self.batch, self.tokens = model, batch, tokens
        self.cache = StaticCache(config=model.lm.config, max_cache_len=prompt_len + tokens)
        self.stream = MimiStream(model.codec, batch)

    def _generate(
        self,
        ids: torch.Tensor,
        new: int,
        sampling: SamplingConfig,
        streamer: BaseStreamer | None,
    ) -> torch.Tensor:
        vocab = self.model.vocab
        self.cache.reset()
        audio_only = AudioOnly(
            vocab.first_unit_id, vocab.last_unit_id + 1, vocab.end_id, None, ids.shape[1]
        )
        return self.model.lm.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            logits_processor=LogitsProcessorList([audio_only]),
            eos_token_id=vocab.end_id,
            pad_token_id=vocab.end_id,
            streamer=streamer,
            **{cache_arg(): self.cache},
        )

    @torch.inference_mode()
    def warm_up(self, prompt_ids: list[int], sampling: SamplingConfig, tokens: int = 24) -> float:
        """A short generate() on the same cache (compiles the step on CUDA); seconds taken."""
        t0 = time.perf_counter()
        ids = torch.tensor([prompt_ids] * self.batch, device=self.model.device)
        self._generate(ids, min(tokens, self.tokens), sampling, None)  # within the cache
        return time.perf_counter() - t0

    @torch.inference_mode()
    def run(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        seed: int,
        chunk_frames: int,
        codec: bool,
        sync: Callable[[], None],
    ) -> tuple[list[float], torch.Tensor]:
        """One timed static batch: per-frame ready times (the same for every stream, which
        arrive together at 0) and the generated tokens [B, tokens]."""
        torch.manual_seed(seed)  # generate() draws from the global RNG
        ids = torch.tensor([prompt_ids] * self.batch, device=self.model.device)
        sync()
        self.stream.reset(torch.arange(self.batch))
        stream = self.stream if codec else None
        clock = _FrameClock(self.model, chunk_frames, stream, time.perf_counter())
        out = self._generate(ids, self.tokens, sampling, clock)
        return clock.ready_s, out[:, len(prompt_ids) :]
