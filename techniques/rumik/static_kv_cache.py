"""Static KV cache: a gpt-fast-style decoder over preallocated cache tensors.

Stock grows a DynamicCache (a cat per layer per token) and goes through transformers'
generic forward with hidden-state capture. This decoder reads the same weights, writes
k/v in place at the current position and attends over the fixed-size cache with a mask,
so every decode step has identical shapes: the precondition for torch.compile and CUDA
graphs. Exact: same math as stock, checked on teacher-forced logits.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrate.api.technique import Technique, TechniqueParams
from orchestrate.families.rumik.engine import DecoderClass, Engine, layer_norm


class CapacityError(ValueError):
    """A sequence does not fit the preallocated cache."""


class StaticKVCacheParams(TechniqueParams):
    max_seq_len: int = Field(2304, ge=16, description="Prompt + generated tokens the cache holds.")
    compile: bool = Field(False, description="torch.compile the decode step.")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"


class StaticDecoder:
    uses_projections = True

    def __init__(self, engine: Engine, max_seq_len: int, compile_mode: str | None):
        lm = engine.model.lm
        cfg = lm.config
        self.proj = engine.projections
        self.attend = engine.attention
        self.embed = lm.model.embed_tokens.weight
        self.norms = [layer.input_layernorm.weight for layer in lm.model.layers]
        self.final_norm = lm.model.norm.weight
        self.eps = cfg.layer_norm_eps
        self.sliding = [t == "sliding_attention" for t in cfg.layer_types]
        self.window = cfg.sliding_window
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.capacity = max_seq_len
        dev, dt = lm.device, lm.dtype
        shape = (len(self.norms), 1, self.hkv, max_seq_len, self.d)
        self.k = torch.zeros(shape, dtype=dt, device=dev)
        self.v = torch.zeros(shape, dtype=dt, device=dev)
        # Same tables as transformers' Cohere2RotaryEmbedding: fp32 angles, interleaved
        # (each frequency repeated twice), cast to the model dtype.
        inv_freq = lm.model.rotary_emb.inv_freq.float().to(dev)
        angles = torch.outer(torch.arange(max_seq_len, device=dev).float(), inv_freq)
        angles = torch.repeat_interleave(angles, 2, dim=-1)
        self.cos, self.sin = angles.cos().to(dt), angles.sin().to(dt)
        self.pos = 0
        self._step = self._forward
        if compile_mode:
            # The caches are written in place every step. Marked as static addresses (as
            # transformers' StaticCache does), inductor's CUDA graphs may keep them instead
            # of refusing the graph for "mutated inputs" (seen on the H200 without this).
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)
            # reduce-overhead needs one whole graph; under an outer CUDA graph (cuda_graph,
            # graph_loop) a graph break around a Triton launch is harmless.
            full = compile_mode == "reduce-overhead"
            self._step = torch.compile(self._forward, mode=compile_mode, fullgraph=full)

    def reset(self) -> None:
        self.pos = 0  # stale cache entries beyond pos are masked, never read

    def prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        n = prompt_ids.shape[1]
        self._check(n)
        positions = torch.arange(n, device=prompt_ids.device)
        hidden = self._forward(prompt_ids, positions)
        self.pos = n
        return hidden[:, -1]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self._check(self.pos + 1)
        positions = torch.tensor([self.pos], device=token.device)
        hidden = self._step(token, positions)
        self.pos += 1
        return hidden[:, -1]

    def _check(self, n: int) -> None:
        if n > self.capacity:
            raise CapacityError(
                f"sequence needs {n} positions; static_kv_cache.max_seq_len is {self.capacity}"
            )

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        for i, norm_w in enumerate(self.norms):
            xn = layer_norm(x, norm_w, self.eps)
            q, k, v, gate, up = self.proj.qkvgu(i, xn)
            q = q.view(1, t, self.hq, self.d).transpose(1, 2)
            k = k.view(1, t, self.hkv, self.d).transpose(1, 2)
            v = v.view(1, t, self.hkv, self.d).transpose(1, 2)
            if self.sliding[i]:  # full-attention layers carry no positional encoding
                q, k = rotate_half_pairs(q, cos, sin), rotate_half_pairs(k, cos, sin)
            self.k[i].index_copy_(2, positions, k)
            self.v[i].index_copy_(2, positions, v)
            window = self.window if self.sliding[i] else None
            attn = self.attend(q, self.k[i], self.v[i], positions, window)
            attn = attn.transpose(1, 2).reshape(1, t, self.hq * self.d)
            x = self.proj.residual(i, x, attn, F.silu(gate) * up)
        return layer_norm(x, self.final_norm, self.eps)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotary in fp32, as transformers' Cohere2 applies it."""
    xf = x.float()
    rotated = torch.stack([-xf[..., 1::2], xf[..., ::2]], dim=-1).flatten(-2)
    return (xf * cos.float() + rotated * sin.float()).to(x.dtype)


class StaticKVCache(Technique):
    name = "static_kv_cache"
    family = "rumik"
    exact = True
    slots = ("decoder",)
    summary = "Preallocated KV cache + fixed-shape decoder (optionally torch.compile'd)."
    Params = StaticKVCacheParams

    def apply(self, engine: Engine) -> None:
        p: StaticKVCacheParams = self.params  # type: ignore[assignment]
        decoder: list[StaticDecoder] = []  # one per engine: compiled code is reused

        def factory(eng: Engine, need: int) -> StaticDecoder:
            if need > p.max_seq_len:
                raise CapacityError(
                    f"sequence needs {need} positions; static_kv_cache.max_seq_len is "
                    f"{p.max_seq_len}"
                )
            if not decoder:
                # A technique that changes the step's math (fused_rope_norm) names a subclass
                # in the decoder_class slot; read when the first decoder is built, so the
                # technique may come after this one in the stack.
                cls: DecoderClass = eng.decoder_class or StaticDecoder
                built = cls(eng, p.max_seq_len, p.compile_mode if p.compile else None)
                if not isinstance(built, StaticDecoder):  # this factory resets and reuses it
                    raise TypeError(
                        f"static_kv_cache builds StaticDecoder subclasses; decoder_class "
                        f"{eng.filled.get('decoder_class')!r} built {type(built).__name__}"
                    )
                decoder.append(built)
            decoder[0].reset()
            return decoder[0]

        engine.decoder_factory = factory
