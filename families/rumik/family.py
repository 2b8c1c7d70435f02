"""The Rumik family's entry points for the worker: build, engine, one timed synthesis."""

from __future__ import annotations

import time

import numpy as np
import torch

from orchestrate.api.config import ModelSpec, Workload
from orchestrate.api.device import sync
from orchestrate.api.family import Family, Serving, StreamRequest, Synthesis
from orchestrate.api.records import FidelityRecord
from orchestrate.api.technique import BuiltStack, Refused
from orchestrate.families.rumik import fidelity
from orchestrate.families.rumik.engine import (
    SLOTS,
    Engine,
    Head,
    Projections,
    stock_engine,
    tensor_bytes,
)
from orchestrate.families.rumik.model import RumikModel, build_model
from orchestrate.families.rumik.presets import PRESETS
from orchestrate.families.rumik.profile import slot_profile
from orchestrate.families.rumik.vocab import build_prompt

SAMPLE_RATE = 24_000
TOKENS_PER_S = 100  # 8 codebook tokens per 80 ms Mimi frame


class RumikFamily(Family):
    name = "rumik"
    slots = SLOTS
    serving_baseline = "rumik-batched"
    frame_s = 0.08  # Mimi at 12.5 Hz: 8 tokens
    presets = tuple(PRESETS)
    summary = "Rumik OSS 1: Cohere2 codec LM (8 Mimi codebooks per 80 ms frame) + Mimi decoder"

    def slot_occupants(self, engine: Engine) -> dict[str, object]:
        occupants = super().slot_occupants(engine)
        occupants["decoder"] = engine.decoder_factory  # the slot builds the decoder
        return occupants

    def build_model(self, spec: ModelSpec) -> RumikModel:
        return build_model(spec)

    def config_hash(self, model: RumikModel) -> str:
        return model.config_hash()

    def build_engine(self, model: RumikModel, stack: BuiltStack) -> Engine:
        engine = stock_engine(model)
        for technique in stack.techniques:
            self.apply_checked(engine, technique)  # refuses an undeclared slot change
            for slot in (*technique.slots, *technique.wraps):
                engine.filled[slot] = technique.name
        return engine

    def step_bytes(self, engine: Engine, context: float) -> int | None:
        """Fewest bytes one decode step must read: the weights this engine's projections and
        head use, norms and stop head, and the K/V a length-aware attention reads at
        `context` positions (sliding layers at most their window). None when a slot
        filled by a plugin does not say what it reads (its part's contract answers None,
        or the part is not built on the contract at all)."""
        proj, head_part = engine.projections, engine.head
        weights = proj.weight_bytes() if isinstance(proj, Projections) else None
        head = head_part.bytes_per_step if isinstance(head_part, Head) else None
        if weights is None or head is None:
            return None
        lm, cfg = engine.model.lm, engine.model.config
        layers = lm.model.layers
        small = tensor_bytes(
            *(layer.input_layernorm.weight for layer in layers),
            lm.model.norm.weight,
            *engine.model.stop_head.parameters(),
        )
        per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * lm.dtype.itemsize
        kv = sum(
            per_position
            * (min(context, cfg.sliding_window) if t == "sliding_attention" else context)
            for t in cfg.layer_types
        )
        return int(weights + head + small + kv)

    def slot_profile(
        self, engine: Engine, text: str, seed: int, workload: Workload
    ) -> dict[str, float]:
        """Milliseconds per decode step per slot (families/rumik/profile.py)."""
        return slot_profile(engine, text, seed, workload, self.synthesize)

    def launches_per_step(
        self, engine: Engine, text: str, seed: int, workload: Workload
    ) -> dict[str, float] | None:
        """Kernels and host launch calls per decode step of this engine's token loop (GPU
        only; None on a CPU), counted by orchestrator/api/device.py (`per_step`)."""
        from orchestrate.api.device import per_step

        model = engine.model
        prompt_ids = model.encode_prompt(build_prompt(text, workload.voice, workload.delivery))

        def run(frames: int) -> int:
            gen = torch.Generator(device=model.device).manual_seed(seed)
            with torch.inference_mode():
                return len(engine.loop(engine, prompt_ids, frames, workload.sampling, gen).tokens)

        return per_step(run, torch.device(model.device))

    @torch.inference_mode()
    def synthesize(self, engine: Engine, text: str, seed: int, workload: Workload) -> Synthesis:
        """Timer scope: prompt construction -> completed CPU waveform, codec included."""
        model = engine.model
        if workload.voice not in model.voices:
            raise ValueError(f"unknown voice {workload.voice!r}; this model has {model.voices}")
        frames = workload.length_policy.frames_for(text)
        generator = torch.Generator(device=model.device).manual_seed(seed)
        device = model.device
        sync(device)
        t0 = time.perf_counter()
        prompt_ids = model.encode_prompt(build_prompt(text, workload.voice, workload.delivery))
        gen = engine.loop(engine, prompt_ids, frames, workload.sampling, generator)
        sync(device)
        t1 = time.perf_counter()
        codes = (
            model.vocab.tokens_to_codes(gen.tokens)
            if frames is None
            else model.vocab.positional_codes(gen.tokens)
        )
        if codes.shape[-1]:
            audio = model.codec.decode(codes.to(device)).audio_values.float().reshape(-1).cpu()
        else:
            audio = torch.zeros(0)
        t2 = time.perf_counter()
        return Synthesis(
            latency_s=t2 - t0,
            lm_s=t1 - t0,
            codec_s=t2 - t1,
            prefill_s=gen.prefill_s,
            prompt_tokens=len(prompt_ids),
            new_tokens=len(gen.tokens),
            frames=int(codes.shape[-1]),
            stop_reason=gen.stop_reason,
            audio=audio.numpy().astype(np.float32),
            sample_rate=SAMPLE_RATE,
        )

    def serving(self, engine: Engine, workload: Workload, streams: int) -> Serving:
        """Stream i speaks prompt i % P with seed (i // P) % S of the workload, for the
        load's fixed number of frames; the server comes from the `server` slot."""
        load = workload.load
        if load is None or engine.server is None:
            raise Refused("serving needs a serving workload and a stack that fills `server`")
        model = engine.model
        if workload.voice not in model.voices:
            raise ValueError(f"unknown voice {workload.voice!r}; this model has {model.voices}")
        ids = {
            p.id: model.encode_prompt(build_prompt(p.text, workload.voice, workload.delivery))
            for p in workload.prompts
        }
        n_prompts, seeds = len(workload.prompts), workload.seeds
        requests = [
            StreamRequest(
                key=i,
                prompt_ids=ids[workload.prompts[i % n_prompts].id],
                frames=load.frames,
                seed=seeds[(i // n_prompts) % len(seeds)],
            )
            for i in range(streams)
        ]
        per_frame = model.vocab.num_quantizers
        longest = max(len(v) for v in ids.values())
        server = engine.server(
            engine, longest + load.frames * per_frame, workload.sampling, load.chunk_frames
        )
        return Serving(
            server=server,
            requests=requests,
            frames=[load.frames] * streams,
            frame_s=per_frame / TOKENS_PER_S,
            warm_up=server.warm_up,
            described=server.described(),
            phases=getattr(server, "phase_seconds", None),
            memory=getattr(server, "memory", None),
            parked=getattr(server, "parked", None),
        )

    def fidelity(
        self, model: RumikModel, engines: dict[str, Engine], workload: Workload, steps: int
    ) -> dict[str, FidelityRecord]:
        """Teacher-force every engine on tokens the stock engine sampled for prompt 0; a
        stack's sampler and loop, wherever they are not stock's, are tested against stock's
        under the same sampling settings and seed (fidelity.judge_slots)."""
        stock = stock_engine(model)
        text = workload.prompts[0].text
        prompt_ids = model.encode_prompt(build_prompt(text, workload.voice, workload.delivery))
        generator = torch.Generator(device=model.device).manual_seed(workload.seeds[0])
        s = workload.sampling
        with torch.inference_mode():
            frames = -(-steps // model.vocab.num_quantizers)  # enough frames for `steps` tokens
            tokens = stock.loop(stock, prompt_ids, frames, s, generator).tokens[:steps]
        ref = fidelity.Reference.build(model, prompt_ids, tokens, s.temperature, s.top_k)
        return {
            name: ref.judge_server(eng, s, workload.seeds[0])
            if eng.server is not None
            else ref.judge(eng, s, workload.seeds[0])
            for name, eng in engines.items()
        }
