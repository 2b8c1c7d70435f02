"""The OmniVoice family's entry points for the worker: build, engine, one timed synthesis, and
several requests served in one batch (`synthesize_many`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from orchestrate.api.config import ModelSpec, Workload
from orchestrate.api.device import sync
from orchestrate.api.family import Family, Serving, Synthesis
from orchestrate.api.records import FidelityRecord
from orchestrate.api.technique import BuiltStack
from orchestrate.families.omnivoice import fidelity
from orchestrate.families.omnivoice.batching import Served, code_frames, generate_many
from orchestrate.families.omnivoice.cost import forward_cost
from orchestrate.families.omnivoice.engine import SLOTS, Engine, stock_engine
from orchestrate.families.omnivoice.model import OmniVoiceModel, build_model
from orchestrate.families.omnivoice.presets import PRESETS
from orchestrate.families.omnivoice.profile import slot_profile
from orchestrate.families.omnivoice.requests import operating_point, request_kwargs


class OmniVoiceFamily(Family):
    name = "omnivoice"
    # `batch` for throughput (copies of one request); `server` for serving workloads (many
    # requests generated together); `knob.<name>` for each decoding knob technique.
    slots = (*SLOTS, "batch", "server", "knob.*")
    presets = tuple(PRESETS)
    baseline = "ov-a"
    workload = "ov-smoke"
    serving_baseline = "ov-batched"
    frame_s = 0.04  # the audio tokenizer's 25 Hz frames (model.frame_rate)
    # What `exact` rests on (the run table's fidelity line): families/omnivoice/fidelity.py.
    fidelity_covers = (
        "stock's canvases teacher-forced through the stack's forward and guidance, and "
        "free-running codes vs stock, same seed (forward, schedule, guidance, unmask and loop "
        "slots, knob.guidance_scale; the codec where a stack fills it); `batch`, `server` "
        "and the other knobs are not covered, per stack below"
    )
    summary = "OmniVoice 0.2.1: masked diffusion over 8 Higgs codebooks (the omnivoice package)"

    def slot_occupants(self, engine: Engine) -> dict[str, object]:
        occupants = super().slot_occupants(engine)
        occupants.update({f"knob.{k}": v for k, v in engine.knobs.items()})
        return occupants

    def build_model(self, spec: ModelSpec) -> OmniVoiceModel:
        return build_model(spec)

    def config_hash(self, model: OmniVoiceModel) -> str:
        return model.config_hash()

    def build_engine(self, model: OmniVoiceModel, stack: BuiltStack) -> Engine:
        engine = stock_engine(model)
        for technique in stack.techniques:
            self.apply_checked(engine, technique)  # refuses an undeclared slot change
            for slot in (*technique.slots, *technique.wraps):
                engine.filled[slot] = technique.name
        engine.finalize()
        engine.config()  # knob errors surface at build time, not in the first timed call
        return engine

    def slot_profile(
        self, engine: Engine, text: str, seed: int, workload: Workload
    ) -> dict[str, float]:
        """Milliseconds per unmasking step per slot (families/omnivoice/profile.py)."""
        return slot_profile(engine, text, seed, workload, self.synthesize)

    def step_bytes(self, engine: Engine, context: float) -> int | None:
        # The worker's floor is per generated token; an unmasking step produces many tokens
        # at once, so a per-token byte count would mislead. Not reported for this family.
        return None

    @torch.inference_mode()
    def synthesize(self, engine: Engine, text: str, seed: int, workload: Workload) -> Synthesis:
        """Timer scope: prompt construction (incl. reference encoding) -> CPU waveform."""
        model, ov = engine.model, engine.model.ov
        point = operating_point(workload, text)
        request = request_kwargs(point, model.sample_rate)
        cfg = engine.config()
        frames = workload.length_policy.frames_for(text)
        duration = None if frames is None else frames / model.frame_rate
        texts = [text] * engine.batch
        torch.manual_seed(seed)  # the package draws Gumbel noise from the global generator
        engine.passes.reset()  # this synthesis's forwards only
        sync(model.device)
        t0 = time.perf_counter()
        task = ov._preprocess_all(
            text=texts,
            preprocess_prompt=cfg.preprocess_prompt,
            duration=duration,
            **request,
        )
        codes = engine.generate_codes(task, cfg)
        sync(model.device)
        t1 = time.perf_counter()
        audios = engine.codec(engine, codes, list(task.ref_rms), cfg)
        t2 = time.perf_counter()
        n_frames = sum(code_frames(c) for c in codes)
        prompt_tokens = _prompt_tokens(ov, task, cfg)
        chunks = len(codes[0]) if isinstance(codes[0], list) else 1  # long-form chunking
        steps, rows = forward_passes(engine, cfg, chunks, batch=len(codes))
        nbytes, flops = forward_cost(
            ov, rows / steps, prompt_tokens + code_frames(codes[0]) // chunks
        )
        return Synthesis(
            latency_s=t2 - t0,
            lm_s=t1 - t0,
            codec_s=t2 - t1,
            prefill_s=None,
            prompt_tokens=prompt_tokens,
            new_tokens=n_frames * ov.config.num_audio_codebook,
            frames=n_frames,
            stop_reason="length_policy",  # lengths come from the duration rule or the policy
            # batch > 1: the copies back to back, so RTF is aggregate audio throughput
            audio=np.concatenate(audios).astype(np.float32),
            sample_rate=model.sample_rate,
            forward_passes=steps,
            forward_bytes=nbytes,
            forward_flops=flops,
        )

    @torch.inference_mode()
    def synthesize_many(
        self, engine: Engine, texts: list[str], seed: int, workload: Workload
    ) -> Served:
        """Several requests in one generate() batch (the package pads its 2B CFG batch to
        the longest row), for serving: each text its own length (the workload's length
        policy, per text). Timer scope as `synthesize`: prompts -> every CPU waveform. One
        seed for the batch: the package draws its noise from the global generator. The
        texts share one operating point (mode, language, reference)."""
        if engine.batch != 1:
            raise ValueError(
                f"synthesize_many serves different requests; the engine's `batch` technique "
                f"makes {engine.batch} copies of one (leave it out of a serving stack)"
            )
        if not texts:
            raise ValueError("synthesize_many needs at least one text")
        model = engine.model
        points = [operating_point(workload, t) for t in texts]
        if any(p != points[0] for p in points):
            raise ValueError("the texts of one batch must share an operating point")
        durations = []
        for text in texts:
            frames = workload.length_policy.frames_for(text)
            durations.append(None if frames is None else frames / model.frame_rate)
        return generate_many(engine, texts, durations, seed, points[0])

    def serving(self, engine: Engine, workload: Workload, streams: int) -> Serving:
        """Stream i speaks prompt i % P for the load's frames; the server comes from the
        `server` slot (requests waiting when a batch starts are generated together)."""
        from orchestrate.families.omnivoice.serving import serving

        return serving(engine, workload, streams)

    def fidelity(
        self, model: OmniVoiceModel, engines: dict[str, Engine], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]:
        return fidelity.against_stock(model, engines, workload, steps)


def forward_passes(engine: Engine, cfg: Any, chunks: int, batch: int) -> tuple[int, int]:
    """(forwards, rows summed over them) of the last generation. The slot loop counts
    them (CFG late-off and early exit change both); the package's own loop runs num_step
    forwards of 2B rows per chunk."""
    counted = engine.passes.total
    if counted.steps:
        return counted.steps, counted.rows
    steps = cfg.num_step * chunks
    return steps, steps * 2 * batch


def _prompt_tokens(ov: Any, task: Any, cfg: Any) -> int:
    """Conditioning length of item 0 (text + reference), computed outside the timer."""
    inp = ov._prepare_inference_inputs(
        task.texts[0],
        task.target_lens[0],
        task.ref_texts[0],
        task.ref_audio_tokens[0],
        task.langs[0],
        task.instructs[0],
        cfg.denoise,
    )
    return int(inp["input_ids"].shape[-1] - task.target_lens[0])
