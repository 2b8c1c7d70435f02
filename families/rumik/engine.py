"""The Rumik engine: a model plus named slots that techniques fill.

Slots, in the order data flows through one decode step:
  decoder        prompt/token ids -> last normed hidden state (owns the KV cache); the
                 engine field is `decoder_factory`, which builds one per sequence
  decoder_class  the fixed-shape decoder class a cache-owning decoder factory builds
                 (None: the factory's own); a technique that changes the step's math names
                 a subclass here
  projections    how a decoder that asks for them computes q,k,v,gate,up and o+down
  attention      how such a decoder attends over its KV cache
  head           hidden -> logits over the columns speech may sample (+ column -> token id)
  sampler        logits -> one token id
  loop           the whole token loop (host loop, or one that runs on the device)
  launch         how kernel-calling parts launch their kernels (LaunchOptions)
  server         many streams at once (serving workloads only): a factory building a
                 server that admits and steps many streams (None in stock: one at a time)

The stock engine is the family's default parts, so "stock" is a stack with no techniques
and every technique is a diff against it. A technique replaces only the slots it declares
and talks to other techniques only through these typed fields: a part keeps its own state
(a captured graph, a loop's buffers) on itself, never in a shared dictionary.
"""

from __future__ import annotations

import abc
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from orchestrate.api.config import SamplingConfig
from orchestrate.api.device import sync
from orchestrate.families.rumik.model import RumikModel

SLOTS = (
    "decoder", "decoder_class", "projections", "attention", "head", "sampler", "loop", "launch",
    "server",
)  # fmt: skip


@cache
def cache_arg() -> str:
    """The forward's cache argument: transformers renamed it (past_key_values -> cache)
    during 5.x. Read when a decoder first runs: importing the modelling code takes seconds
    that a command listing or validating stacks should not pay."""
    from transformers import Cohere2ForCausalLM

    forward = inspect.signature(Cohere2ForCausalLM.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"


# ------------------------------------------------------------------- slot contracts


class Decoder(Protocol):
    uses_projections: bool  # reads the projections and attention slots

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """[1, P] ids -> [1, H] normed hidden state of the last position."""

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """[1, 1] id of the token just sampled -> [1, H] normed hidden state."""


class DecoderClass(Protocol):
    """The `decoder_class` slot: (engine, max_seq_len, compile_mode) -> Decoder, the
    constructor of static_kv_cache's decoder or of a subclass with the same signature."""

    def __call__(self, engine: Engine, max_seq_len: int, compile_mode: str | None) -> Decoder: ...


class Projections(abc.ABC):
    """The `projections` slot. A projections object may also offer
    `output(i, attn, act)`: o_proj(attn) + down_proj(act) without the residual add, for a
    decoder that fuses the add into its next norm; and, where o_proj and down_proj are one
    packed weight, `output_packed(i, attn_act)`: the same from the already concatenated
    [attn, act] row, for a decoder that writes that row in one kernel."""

    # True for projections batched_decode's server may step through (many rows at once);
    # such an object also offers `tensors()`, every tensor its step reads (for memory()).
    serves_rows: bool = False
    # True for projections that also take activation rows quantized by the caller's
    # kernels (fp8_projections: `qkvgu_rows(i, xq, xs, dtype)`, `residual_rows(i, x, attn,
    # aq, a_s)`), so a decoder with kernel glue quantizes inside its norm and SwiGLU.
    quantized_rows: bool = False

    @abc.abstractmethod
    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's q, k, v, gate and up projections of the normed input."""

    @abc.abstractmethod
    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        """x + o_proj(attn) + down_proj(act) for layer i."""

    def weight_bytes(self) -> int | None:
        """Bytes of weights one decode step reads through these projections; None when
        unknown (the family then reports no step-byte floor)."""
        return None


@dataclass
class HeadLogits:
    logits: torch.Tensor  # [1, C], float32
    column_ids: torch.Tensor | None  # [C] token id of each column; None = identity (full vocab)
    end_column: int  # the column of end-of-audio
    unit_columns: slice | torch.Tensor  # columns holding audio units


class Head(abc.ABC):
    """The `head` slot: hidden -> HeadLogits at decode step `step` (an int, or a device
    counter inside a captured loop)."""

    # Weight bytes one call reads (the family's step-byte floor); None when unknown.
    bytes_per_step: int | None = None

    @abc.abstractmethod
    def __call__(self, hidden: torch.Tensor, step: int | torch.Tensor) -> HeadLogits: ...


class Sampler(Protocol):
    def __call__(
        self,
        head: HeadLogits,
        *,
        allow_end: bool,
        force_end: bool,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> torch.Tensor:
        """-> [1, 1] token id (a device tensor)."""


@dataclass
class Generation:
    tokens: list[int]
    stop_reason: str
    prefill_s: float | None = None


class Loop(Protocol):
    def __call__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        frames: int | None,
        sampling: SamplingConfig,
        generator: torch.Generator,
    ) -> Generation: ...


@dataclass(frozen=True)
class LaunchOptions:
    """The `launch` slot: how every kernel-calling part (projections, attention, sampler,
    fused decoder) launches its Triton kernels. Parts read it at call time, so one technique
    (pdl) switches all of them without reaching into any."""

    pdl: bool = False  # programmatic dependent launch (Hopper); see techniques/rumik/pdl.py


# --------------------------------------------------------------------------- engine


@dataclass
class Engine:
    model: RumikModel
    decoder_factory: Callable[[Engine, int], Decoder]  # (engine, max_seq_len) -> Decoder
    projections: Projections
    attention: Callable[..., torch.Tensor]
    head: Head
    sampler: Sampler
    loop: Loop
    decoder_class: DecoderClass | None = None
    launch: LaunchOptions = field(default_factory=LaunchOptions)
    server: ServerFactory | None = None
    filled: dict[str, str] = field(default_factory=dict)  # slot -> technique that filled it

    def new_decoder(self, max_seq_len: int) -> Decoder:
        decoder = self.decoder_factory(self, max_seq_len)
        for slot in ("projections", "attention"):
            if slot in self.filled and not decoder.uses_projections:
                # A filled slot nobody reads would be a silent no-op: refuse it.
                raise RuntimeError(
                    f"technique {self.filled[slot]!r} fills {slot!r}, but the decoder in use "
                    "does not read that slot"
                )
        return decoder

    def stop_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model.stop_head(hidden).float())


class ServerFactory(Protocol):
    """(engine, cache positions per row, sampling, frames per audio chunk) -> a server of
    many streams (api.family.StreamServer, with `warm_up() -> int`, the graphs it captured,
    and `described() -> dict[str, str]`, what it does in words). `rows`: that many cache rows
    instead of the technique's own (fidelity teacher-forces a small server beside the timed
    one); the server's `dec.teacher_forced(prompts, tokens)` runs its step on given tokens."""

    def __call__(
        self,
        engine: Engine,
        max_seq_len: int,
        sampling: SamplingConfig,
        chunk_frames: int,
        rows: int | None = None,
    ) -> Any: ...


# ------------------------------------------------------------------- stock parts


class StockDecoder:
    """Upstream's forward: transformers Cohere2 with a DynamicCache and all hidden states."""

    uses_projections = False

    def __init__(self, engine: Engine, max_seq_len: int):
        from transformers import DynamicCache

        self.lm = engine.model.lm
        self.cache = DynamicCache(config=self.lm.config)

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        # Upstream calls the full LM here, projecting every prompt position through the
        # 277k head; we pay that too so stock is not made faster than upstream.
        out = self.lm(
            input_ids=prompt_ids,
            use_cache=True,
            output_hidden_states=True,
            **{cache_arg(): self.cache},
        )
        return out.hidden_states[-1][:, -1, :]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        out = self.lm.model(
            input_ids=token,
            use_cache=True,
            output_hidden_states=True,
            **{cache_arg(): self.cache},
        )
        return out.hidden_states[-1][:, -1, :]


def stock_decoder(engine: Engine, max_seq_len: int) -> Decoder:
    return StockDecoder(engine, max_seq_len)


class FullVocabHead(Head):
    """The tied 277k-row output head: every vocabulary id gets a logit."""

    def __init__(self, model: RumikModel):
        vocab = model.vocab
        self.lm = model.lm
        self.end_id = vocab.end_id
        self.units = slice(vocab.first_unit_id, vocab.last_unit_id + 1)
        self.bytes_per_step = tensor_bytes(self.lm.lm_head.weight)

    def __call__(self, hidden: torch.Tensor, step: int | torch.Tensor) -> HeadLogits:
        logits = self.lm.lm_head(hidden) * self.lm.logit_scale
        return HeadLogits(logits.float(), None, self.end_id, self.units)


def stock_sampler(
    head: HeadLogits,
    *,
    allow_end: bool,
    force_end: bool,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Upstream's constrained top-k: a fresh -inf mask over every column each step."""
    logits = head.logits
    mask = torch.full_like(logits, float("-inf"))
    if force_end:
        mask[:, head.end_column] = 0.0
    else:
        mask[:, head.unit_columns] = 0.0
        if allow_end:
            mask[:, head.end_column] = 0.0
    scores = (logits + mask) / sampling.temperature
    k = min(sampling.top_k, scores.shape[-1])
    top_vals, top_idx = torch.topk(scores, k, dim=-1)
    probs = torch.softmax(top_vals, dim=-1)
    if sampling.top_p < 1.0:
        keep = probs.cumsum(-1) - probs < sampling.top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    pick = torch.multinomial(probs, 1, generator=generator)
    column = top_idx.gather(-1, pick)
    return column if head.column_ids is None else head.column_ids[column]


def token_budget(sampling: SamplingConfig, frames: int | None, per_frame: int) -> int:
    """Tokens a loop may generate: the cap, or exactly the length policy's frames."""
    if frames is None:
        return sampling.max_new_tokens
    return min(sampling.max_new_tokens, frames * per_frame)


def host_loop(
    engine: Engine,
    prompt_ids: list[int],
    frames: int | None,
    sampling: SamplingConfig,
    generator: torch.Generator,
) -> Generation:
    """Upstream's per-token Python loop, one host round trip per token.

    With a length policy (`frames` set) the end token is never allowed and the stop head is
    still evaluated (its cost is paid) but not obeyed, so every stack makes equal lengths.
    """
    model = engine.model
    device = model.device
    cap = token_budget(sampling, frames, model.vocab.num_quantizers)
    decoder = engine.new_decoder(len(prompt_ids) + cap + 1)
    if reset := getattr(engine.sampler, "reset", None):  # samplers with device RNG state
        reset(generator.initial_seed())
    t0 = time.perf_counter()
    hidden = decoder.prefill(torch.tensor([prompt_ids], device=device))
    prefill_s = timed_since(t0, device)  # one sync per clip; the loop syncs every token anyway
    tokens: list[int] = []
    token = None
    for step in range(cap):
        if token is not None:
            hidden = decoder.step(token.view(1, 1))
        head = engine.head(hidden, step)
        force_end = False
        if step >= sampling.min_tokens_before_stop:
            stop = engine.stop_probability(hidden).item() > 0.5  # host sync, as upstream
            force_end = stop and frames is None
        allow_end = frames is None and step >= sampling.min_tokens_before_stop
        token = engine.sampler(
            head, allow_end=allow_end, force_end=force_end, sampling=sampling, generator=generator
        )
        token_id = int(token.item())
        if token_id == model.vocab.end_id:
            return Generation(tokens, "stop_head" if force_end else "end_token", prefill_s)
        tokens.append(token_id)
    return Generation(tokens, "token_cap" if frames is None else "length_policy", prefill_s)


class SeparateProjections(Projections):
    """The five input and two output projections as separate matmuls, as in stock."""

    def __init__(self, model: RumikModel):
        self.layers = [(layer.self_attn, layer.mlp) for layer in model.lm.model.layers]

    def qkvgu(self, i: int, xn: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, m = self.layers[i]
        return a.q_proj(xn), a.k_proj(xn), a.v_proj(xn), m.gate_proj(xn), m.up_proj(xn)

    def weight_bytes(self) -> int:
        return sum(
            tensor_bytes(lin.weight)
            for a, m in self.layers
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        )

    def residual(
        self, i: int, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor
    ) -> torch.Tensor:
        a, m = self.layers[i]
        return x + a.o_proj(attn) + m.down_proj(act)  # transformers' order of the two adds


def masked_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Attend over the whole fixed-size cache, masking positions not yet (or no longer) seen.

    q [1, Hq, T, D] at `positions` [T]; caches [1, Hkv, S, D]. Reads all S positions every
    step: the cost a length-aware kernel removes.
    """
    kv = torch.arange(k_cache.shape[2], device=q.device)
    ahead = positions[:, None] - kv[None, :]  # query position - key position
    visible = ahead >= 0
    if window is not None:
        visible = visible & (ahead < window)
    return F.scaled_dot_product_attention(
        q,
        k_cache,
        v_cache,
        attn_mask=visible[None, None],
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )


def stock_engine(model: RumikModel) -> Engine:
    return Engine(
        model=model,
        decoder_factory=stock_decoder,
        projections=SeparateProjections(model),
        attention=masked_sdpa,
        head=FullVocabHead(model),
        sampler=stock_sampler,
        loop=host_loop,
    )


def timed_since(t0: float, device: torch.device) -> float:
    """Seconds since `t0` once the device has finished the work queued so far."""
    sync(device)
    return time.perf_counter() - t0


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere2's bias-free LayerNorm, computed in fp32 as transformers does."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None, eps)
    return y.to(x.dtype)
