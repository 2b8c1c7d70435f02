"""The OmniVoice engine: the package's generate path plus named slots techniques fill.

Slots, in the order one unmasking step uses them:
  forward   padded 2B batch (cond rows, then uncond rows) -> logits [R, C, S, V]
  schedule  how many positions each step unmasks (num_step, t_shift)
  guidance  whether a step runs the unconditioned rows, and how log-probs combine (CFG)
  unmask    which masked positions a step commits (and whether the loop may exit early)
  loop      the whole iterative unmasking loop
  codec     codes -> waveforms (the Higgs audio tokenizer's decoder, then post-processing)

Stock is the package itself: `loop` calls OmniVoice._generate_iterative. When a technique
fills forward/schedule/guidance/unmask, the loop becomes `slot_loop`, a faithful
re-implementation of _generate_iterative that calls the slots (tests prove it returns the
same codes as OmniVoice.generate() for the same seed). Loops that read those slots are
`SlotReadingLoop`s and count the forwards they run in the engine's `passes`.

Knobs (num_step, guidance_scale, ...) are the package's OmniVoiceGenerationConfig, validated
by name here because the package silently drops names it does not know.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from orchestrate.families.omnivoice.model import OmniVoiceModel

if TYPE_CHECKING:
    from omnivoice.models.omnivoice import GenerationTask, OmniVoiceGenerationConfig

# The omnivoice package (and the transformers modelling code it pulls in: about 5 s) is
# imported when an engine first needs it, not when the plugin catalogue lists this family:
# every CLI command and worker loads the catalogue, most never build an OmniVoice model.

SLOTS = ("forward", "schedule", "guidance", "unmask", "loop", "codec")
LOOP_SLOTS = ("forward", "schedule", "guidance", "unmask")  # read only by slot_loop


@cache
def knob_names() -> tuple[str, ...]:
    """The package's decoding knobs: OmniVoiceGenerationConfig's fields."""
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    return tuple(f.name for f in fields(OmniVoiceGenerationConfig))


class KnobError(ValueError):
    """A generation knob that does not exist or has a value the package cannot use."""


def generation_config(knobs: dict[str, Any]) -> OmniVoiceGenerationConfig:
    """The package's config from `knobs`, refusing what its from_dict would silently drop."""
    from omnivoice.models.omnivoice import OmniVoiceGenerationConfig

    valid = knob_names()
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise KnobError(f"unknown generation knob(s) {unknown}; valid: {', '.join(valid)}")
    cfg = OmniVoiceGenerationConfig(**knobs)
    if not isinstance(cfg.num_step, int) or cfg.num_step < 1:
        raise KnobError(f"num_step must be an integer >= 1, got {cfg.num_step!r}")
    for name in ("guidance_scale", "position_temperature", "class_temperature"):
        if getattr(cfg, name) < 0:
            raise KnobError(f"{name} must be >= 0, got {getattr(cfg, name)!r}")
    if cfg.t_shift <= 0:
        raise KnobError(f"t_shift must be > 0, got {cfg.t_shift!r}")
    return cfg


# ------------------------------------------------------------------- slot contracts


class Forward(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, audio_mask: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """[R, C, S] ids, [R, S] audio mask, [R, 1, S, S] bool mask -> [R, C, S, V] logits."""


Schedule = Callable[[list[int], "OmniVoiceGenerationConfig", int], list[list[int]]]


class Guidance(Protocol):
    def uncond_rows(self, step: int, cfg: OmniVoiceGenerationConfig) -> bool:
        """Whether step `step` runs the unconditioned rows at all."""

    def log_probs(
        self, c: torch.Tensor, u: torch.Tensor | None, cfg: OmniVoiceGenerationConfig
    ) -> torch.Tensor:
        """Guided log-probs [1, C, T, V] from cond (and uncond) logits."""


class Unmask(Protocol):
    def __call__(
        self,
        log_probs: torch.Tensor,
        tokens: torch.Tensor,
        k: int,
        step: int,
        cfg: OmniVoiceGenerationConfig,
        mask_id: int,
    ) -> None:
        """Commit positions of `tokens` [1, C, T] (in place) from guided `log_probs`."""


Loop = Callable[["Engine", "GenerationTask", "OmniVoiceGenerationConfig"], list[torch.Tensor]]


class SlotReadingLoop(abc.ABC):
    """A `loop` that calls the loop-internal slots itself (forward and schedule at least;
    a guidance or unmask it does not read it must refuse, never ignore) and records the
    forwards it runs with `engine.passes.record`. Only such a loop may run with those
    slots filled (Engine.finalize); the package's own loop reads none of them."""

    @abc.abstractmethod
    def __call__(
        self, engine: Engine, task: GenerationTask, cfg: OmniVoiceGenerationConfig
    ) -> list[torch.Tensor]: ...


# (engine, per-item codes [C, T] or long-form chunk lists, per-item reference RMS, cfg)
Codec = Callable[
    ["Engine", list[Any], list[float | None], "OmniVoiceGenerationConfig"], list[np.ndarray]
]


# ------------------------------------------------------------------- stock slot parts


def package_forward(model: OmniVoiceModel) -> Forward:
    ov = model.ov

    def forward(input_ids, audio_mask, attention_mask):
        return ov(input_ids=input_ids, audio_mask=audio_mask, attention_mask=attention_mask).logits

    return forward


def package_schedule(
    target_lens: list[int], cfg: OmniVoiceGenerationConfig, codebooks: int
) -> list[list[int]]:
    """Positions unmasked per step, per item: _generate_iterative's schedule, verbatim."""
    from omnivoice.models.omnivoice import _get_time_steps

    timesteps = _get_time_steps(0.0, 1.0, cfg.num_step, cfg.t_shift).tolist()
    schedules = []
    for t_len in target_lens:
        total = t_len * codebooks
        rem = total
        sched = []
        for step in range(cfg.num_step):
            last = step == cfg.num_step - 1
            num = (
                rem
                if last
                else min(math.ceil(total * (timesteps[step + 1] - timesteps[step])), rem)
            )
            sched.append(int(num))
            rem -= int(num)
        schedules.append(sched)
    return schedules


class StockGuidance:
    """The package's CFG: every step runs 2B rows; guidance_scale=0 ignores the uncond rows
    but still computes them (why cfg_late_off is a technique, not a knob value)."""

    def uncond_rows(self, step: int, cfg: OmniVoiceGenerationConfig) -> bool:
        return True

    def log_probs(self, c, u, cfg):
        if cfg.guidance_scale != 0 and u is not None:
            c_lp = F.log_softmax(c, dim=-1)
            u_lp = F.log_softmax(u, dim=-1)
            return torch.log_softmax(c_lp + cfg.guidance_scale * (c_lp - u_lp), dim=-1)
        return F.log_softmax(c, dim=-1)


def predict(log_probs: torch.Tensor, cfg: OmniVoiceGenerationConfig, mask_id: int):
    """Tokens and confidences from guided log-probs: _predict_tokens_with_scoring's tail."""
    from omnivoice.models.omnivoice import _filter_top_k, _gumbel_sample

    log_probs[..., mask_id] = -float("inf")
    if cfg.class_temperature > 0.0:
        filtered = _filter_top_k(log_probs, ratio=0.1)
        pred = _gumbel_sample(filtered, cfg.class_temperature).argmax(dim=-1)
    else:
        pred = log_probs.argmax(dim=-1)
    return pred, log_probs.max(dim=-1)[0]


def position_scores(
    scores: torch.Tensor, tokens: torch.Tensor, cfg: OmniVoiceGenerationConfig, mask_id: int
) -> torch.Tensor:
    """Layer penalty, Gumbel position noise (a seeded draw), committed positions at -inf."""
    from omnivoice.models.omnivoice import _gumbel_sample

    layer_ids = torch.arange(tokens.shape[1], device=scores.device).view(1, -1, 1)
    scores = scores - layer_ids * cfg.layer_penalty_factor
    if cfg.position_temperature > 0.0:
        scores = _gumbel_sample(scores, cfg.position_temperature)
    return scores.masked_fill(tokens != mask_id, -float("inf"))


def stock_unmask(log_probs, tokens, k, step, cfg, mask_id) -> None:
    """Commit the k best-scored masked positions (package order of random draws)."""
    pred, scores = predict(log_probs, cfg, mask_id)
    scores = position_scores(scores, tokens, cfg, mask_id)
    _, idx = torch.topk(scores.flatten(), k)
    flat = tokens.flatten()
    flat[idx] = pred.flatten()[idx]
    tokens.copy_(flat.view_as(tokens))


# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class Passes:
    steps: int = 0  # forward passes
    rows: int = 0  # batch rows, summed over those forwards


@dataclass
class PassCount:
    """Forwards the slot-reading loops ran, for the worker's per-forward metrics: `total`
    since the family's reset at the start of a synthesis (long-form chunks call the loop
    once each, so it adds up), `last` of the latest loop call. The package's own loop
    counts nothing: total.steps == 0 means "not counted"."""

    total: Passes = field(default_factory=Passes)
    last: Passes = field(default_factory=Passes)

    def record(self, steps: int, rows: int) -> None:
        self.last = Passes(steps, rows)
        self.total = Passes(self.total.steps + steps, self.total.rows + rows)

    def reset(self) -> None:
        self.total = self.last = Passes()


@dataclass
class Engine:
    model: OmniVoiceModel
    forward: Forward
    schedule: Schedule
    guidance: Guidance
    unmask: Unmask
    loop: Loop
    codec: Codec
    knobs: dict[str, Any] = field(default_factory=dict)  # OmniVoiceGenerationConfig fields
    batch: int = 1  # copies of each request generated together (throughput)
    # Serving workloads: (engine, workload) -> a server of many requests (None: one at a time)
    server: Any = None
    filled: dict[str, str] = field(default_factory=dict)  # slot -> technique that filled it
    passes: PassCount = field(default_factory=PassCount)  # written by slot-reading loops

    def config(self) -> OmniVoiceGenerationConfig:
        return generation_config(self.knobs)

    def finalize(self) -> Engine:
        """After techniques: any filled loop-internal slot needs the slot-reading loop."""
        uses_slots = any(s in self.filled for s in LOOP_SLOTS)
        if uses_slots and self.loop is package_loop:
            self.loop = slot_loop
        elif uses_slots and "loop" in self.filled and not isinstance(self.loop, SlotReadingLoop):
            # A filled slot nobody reads would be a silent no-op: refuse it.
            slots = [s for s in LOOP_SLOTS if s in self.filled]
            raise RuntimeError(
                f"slots {slots} are filled but loop {self.filled['loop']!r} does not read them"
            )
        return self

    def generate_codes(self, task: GenerationTask, cfg: OmniVoiceGenerationConfig) -> list[Any]:
        """generate()'s dispatch: short items through `loop`, long ones through the package's
        chunker (whose inner _generate_iterative is this engine's loop)."""
        ov = self.model.ov
        short_idx, long_idx = task.get_indices(cfg, self.model.frame_rate)
        results: list[Any] = [None] * task.batch_size
        if short_idx:
            out = self.loop(self, task.slice_task(short_idx), cfg)
            for i, r in zip(short_idx, out, strict=True):
                results[i] = r
        if long_idx:
            with self._loop_bound():
                out = ov._generate_chunked(task.slice_task(long_idx), cfg)
            for i, r in zip(long_idx, out, strict=True):
                results[i] = r
        return results

    @contextmanager
    def _loop_bound(self):
        ov = self.model.ov
        if self.loop is package_loop:
            yield
            return
        # Instance attribute for one call only; the shared model is restored in `finally`.
        ov._generate_iterative = lambda task, cfg: self.loop(self, task, cfg)
        try:
            yield
        finally:
            del ov._generate_iterative


def stock_engine(model: OmniVoiceModel, reimplemented: bool = False) -> Engine:
    """The package's generate path; `reimplemented` runs slot_loop with the stock slots."""
    knobs: dict[str, Any] = {}
    if model.random_weights:
        # Random codec output sits near -51 dBFS; post-processing may trim it to nothing.
        knobs["postprocess_output"] = False
    return Engine(
        model=model,
        forward=package_forward(model),
        schedule=package_schedule,
        guidance=StockGuidance(),
        unmask=stock_unmask,
        loop=slot_loop if reimplemented else package_loop,
        codec=package_codec,
        knobs=knobs,
    )


def package_codec(
    engine: Engine, codes: list[Any], rms: list[float | None], cfg: OmniVoiceGenerationConfig
) -> list[np.ndarray]:
    """Stock: the package decodes (and post-processes) one item at a time."""
    ov = engine.model.ov
    return [ov._decode_and_post_process(c, r, cfg) for c, r in zip(codes, rms, strict=True)]


# ---------------------------------------------------------------------------- loops


def package_loop(
    engine: Engine, task: GenerationTask, cfg: OmniVoiceGenerationConfig
) -> list[torch.Tensor]:
    """Stock: the package's own unmasking loop."""
    return engine.model.ov._generate_iterative(task, cfg)


@dataclass
class CFGBatch:
    """_generate_iterative's padded batch: rows 0..B-1 conditioned, B..2B-1 unconditioned."""

    input_ids: torch.Tensor  # [2B, C, S]
    audio_mask: torch.Tensor  # [2B, S]
    attention_mask: torch.Tensor  # [2B, 1, S, S] bool
    c_lens: list[int]
    t_lens: list[int]


def build_cfg_batch(engine: Engine, task: GenerationTask, cfg: OmniVoiceGenerationConfig):
    ov, device = engine.model.ov, engine.model.device
    B, C = task.batch_size, ov.config.num_audio_codebook
    inputs = [
        ov._prepare_inference_inputs(
            task.texts[i],
            task.target_lens[i],
            task.ref_texts[i],
            task.ref_audio_tokens[i],
            task.langs[i],
            task.instructs[i],
            cfg.denoise,
        )
        for i in range(B)
    ]
    c_lens = [inp["input_ids"].size(2) for inp in inputs]
    S = max(c_lens)
    ids = torch.full((2 * B, C, S), ov.config.audio_mask_id, dtype=torch.long, device=device)
    audio_mask = torch.zeros((2 * B, S), dtype=torch.bool, device=device)
    attn = torch.zeros((2 * B, 1, S, S), dtype=torch.bool, device=device)
    for i, inp in enumerate(inputs):
        c_len, u_len = c_lens[i], task.target_lens[i]
        ids[i, :, :c_len] = inp["input_ids"]
        audio_mask[i, :c_len] = inp["audio_mask"]
        attn[i, :, :c_len, :c_len] = True
        ids[B + i, :, :u_len] = inp["input_ids"][..., -u_len:]
        audio_mask[B + i, :u_len] = inp["audio_mask"][..., -u_len:]
        attn[B + i, :, :u_len, :u_len] = True
        if u_len < S:  # padded rows attend to themselves only (no all-masked softmax rows)
            pad = torch.arange(u_len, S, device=device)
            attn[B + i, :, pad, pad] = True
    return CFGBatch(ids, audio_mask, attn, c_lens, list(task.target_lens))


class SlotLoop(SlotReadingLoop):
    """_generate_iterative, step for step and draw for draw, through the engine's slots."""

    def __call__(
        self, engine: Engine, task: GenerationTask, cfg: OmniVoiceGenerationConfig
    ) -> list[torch.Tensor]:
        ov = engine.model.ov
        B, C, mask_id = task.batch_size, ov.config.num_audio_codebook, ov.config.audio_mask_id
        batch = build_cfg_batch(engine, task, cfg)
        tokens = torch.full(
            (B, C, max(task.target_lens)), mask_id, dtype=torch.long, device=engine.model.device
        )
        schedules = engine.schedule(task.target_lens, cfg, C)
        steps_run = rows_run = 0
        for step in range(cfg.num_step):
            if getattr(engine.unmask, "done", None) and engine.unmask.done(tokens, batch, mask_id):
                break  # early exit (e.g. confidence_parallel): nothing left to unmask
            uncond = engine.guidance.uncond_rows(step, cfg)
            rows = 2 * B if uncond else B  # conditioned rows only: really half the batch
            logits = engine.forward(
                batch.input_ids[:rows], batch.audio_mask[:rows], batch.attention_mask[:rows]
            ).to(torch.float32)
            steps_run, rows_run = steps_run + 1, rows_run + rows
            for i in range(B):
                k = schedules[i][step]
                if k <= 0:
                    continue
                c_len, t_len = batch.c_lens[i], batch.t_lens[i]
                c_logits = logits[i : i + 1, :, c_len - t_len : c_len, :]
                u_logits = logits[B + i : B + i + 1, :, :t_len, :] if uncond else None
                log_probs = engine.guidance.log_probs(c_logits, u_logits, cfg)
                sample = tokens[i : i + 1, :, :t_len]
                engine.unmask(log_probs, sample, k, step, cfg, mask_id)
                batch.input_ids[i : i + 1, :, c_len - t_len : c_len] = sample
                batch.input_ids[B + i : B + i + 1, :, :t_len] = sample
        engine.passes.record(steps_run, rows_run)
        return [tokens[i, :, : task.target_lens[i]] for i in range(B)]


slot_loop = SlotLoop()  # stateless: one instance serves every engine
