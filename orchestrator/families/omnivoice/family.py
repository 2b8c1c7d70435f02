"""The OmniVoice family's entry points for the worker: build, engine, one timed synthesis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestrator.config import REPO_ROOT, ModelSpec, OperatingPoint, Workload
from orchestrator.environment import sync
from orchestrator.families import Synthesis
from orchestrator.families.omnivoice import fidelity
from orchestrator.families.omnivoice.cost import forward_cost
from orchestrator.families.omnivoice.engine import Engine, stock_engine
from orchestrator.families.omnivoice.model import OmniVoiceModel, build_model
from orchestrator.records import FidelityRecord
from orchestrator.registry import BuiltStack


class OmniVoiceFamily:
    name = "omnivoice"

    def build_model(self, spec: ModelSpec) -> OmniVoiceModel:
        return build_model(spec)

    def config_hash(self, model: OmniVoiceModel) -> str:
        return model.config_hash()

    def build_engine(self, model: OmniVoiceModel, stack: BuiltStack) -> Engine:
        engine = stock_engine(model)
        for technique in stack.techniques:
            technique.apply(engine)
            for slot in (*technique.slots, *technique.wraps):
                engine.filled[slot] = technique.name
        engine.finalize()
        engine.config()  # knob errors surface at build time, not in the first timed call
        return engine

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
        engine.notes.pop("passes", None)
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
        n_frames = sum(_frames(c) for c in codes)
        prompt_tokens = _prompt_tokens(ov, task, cfg)
        chunks = len(codes[0]) if isinstance(codes[0], list) else 1  # long-form chunking
        steps, rows = forward_passes(engine, cfg, chunks, batch=len(codes))
        nbytes, flops = forward_cost(ov, rows / steps, prompt_tokens + _frames(codes[0]) // chunks)
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

    def fidelity(
        self, model: OmniVoiceModel, engines: dict[str, Engine], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]:
        return fidelity.against_stock(model, engines, workload, steps)


# ---------------------------------------------------------------------- requests


def operating_point(workload: Workload, text: str) -> OperatingPoint:
    """The settings of the prompt with this text (the worker passes text only)."""
    for p in workload.prompts:
        if p.text == text and p.point is not None:
            return workload.operating_points[p.point]
    return OperatingPoint()


def request_kwargs(point: OperatingPoint, sample_rate: int) -> dict[str, Any]:
    """generate()'s mode arguments for one operating point; clone needs a transcript."""
    out: dict[str, Any] = {"language": point.language}
    if point.mode == "design":
        if not point.instruct:
            raise ValueError("design mode needs an instruct (e.g. 'female, british accent')")
        out["instruct"] = point.instruct
    elif point.mode == "clone":
        if not point.ref_audio:
            raise ValueError("clone mode needs ref_audio (a WAV file)")
        if not point.ref_text:
            # Without it the package downloads Whisper to transcribe the reference.
            raise ValueError(
                "clone mode needs ref_text, the transcript of ref_audio: without it the "
                "omnivoice package would download a Whisper model to transcribe it"
            )
        out["ref_audio"] = load_reference(point.ref_audio)
        out["ref_text"] = point.ref_text
    return out


def load_reference(path: str) -> tuple[torch.Tensor, int]:
    """(waveform [1, T], sample rate) read with soundfile; relative paths are from the repo.

    Passing a tensor keeps torchaudio's file loaders (and their codec backends) out of it.
    """
    import soundfile as sf

    p = Path(path)
    if not p.is_absolute():
        p = REPO_ROOT / p
    if not p.exists():
        raise FileNotFoundError(f"reference audio {str(p)!r} does not exist")
    data, sr = sf.read(str(p), dtype="float32", always_2d=True)
    return torch.from_numpy(data.mean(axis=1)[None, :].copy()), int(sr)


def forward_passes(engine: Engine, cfg: Any, chunks: int, batch: int) -> tuple[int, int]:
    """(forwards, rows summed over them) of the last generation. The slot loop counts
    them (CFG late-off and early exit change both); the package's own loop runs num_step
    forwards of 2B rows per chunk."""
    counted = engine.notes.pop("passes", None)
    if counted and counted["steps"]:
        return counted["steps"], counted["rows"]
    steps = cfg.num_step * chunks
    return steps, steps * 2 * batch


def _frames(codes: Any) -> int:
    if isinstance(codes, list):  # chunked long-form: one tensor per chunk
        return sum(int(c.shape[-1]) for c in codes)
    return int(codes.shape[-1])


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
