"""Several OmniVoice requests in one generate() batch, each of its own length.

The package pads its 2B CFG batch to the longest row; each request keeps the frames it has
alone (tests/test_omnivoice.py). Used by `OmniVoiceFamily.synthesize_many` (the serving
benchmark) and the serving workloads' server (serving.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from orchestrate.api.device import sync
from orchestrate.families.omnivoice.engine import Engine
from orchestrate.families.omnivoice.requests import request_kwargs


@dataclass(frozen=True)
class Served:
    """One batch of requests served together (`synthesize_many`): they arrive together and
    finish together, so each request's latency is the batch's."""

    latency_s: float  # prompts -> every waveform on the CPU
    lm_s: float
    codec_s: float
    frames: list[int]  # per request
    audio: list[np.ndarray]  # per request
    sample_rate: int

    @property
    def audio_s(self) -> float:
        return sum(len(a) for a in self.audio) / self.sample_rate


@torch.inference_mode()
def generate_many(
    engine: Engine, texts: list[str], durations: list[float | None], seed: int, point: Any
) -> Served:
    """`texts` in one generate() batch, each of its own duration (None: the package's
    estimate), sharing the operating point `point`. Timer scope: prompts -> every CPU
    waveform. One seed for the batch: the package draws its noise from the global generator."""
    model, ov = engine.model, engine.model.ov
    request = request_kwargs(point, model.sample_rate)
    cfg = engine.config()
    torch.manual_seed(seed)
    engine.passes.reset()
    sync(model.device)
    t0 = time.perf_counter()
    task = ov._preprocess_all(
        text=list(texts), preprocess_prompt=cfg.preprocess_prompt, duration=durations,
        **request,
    )  # fmt: skip
    codes = engine.generate_codes(task, cfg)
    sync(model.device)
    t1 = time.perf_counter()
    audios = engine.codec(engine, codes, list(task.ref_rms), cfg)
    t2 = time.perf_counter()
    return Served(
        latency_s=t2 - t0,
        lm_s=t1 - t0,
        codec_s=t2 - t1,
        frames=[code_frames(c) for c in codes],
        audio=[np.asarray(a, dtype=np.float32) for a in audios],
        sample_rate=model.sample_rate,
    )


def code_frames(codes: Any) -> int:
    """Frames of one request's codes (a tensor, or one per chunk of a long-form request)."""
    if isinstance(codes, list):  # chunked long-form: one tensor per chunk
        return sum(int(c.shape[-1]) for c in codes)
    return int(codes.shape[-1])
