"""Packed projections: the backbone's q, k, v in one matmul, and its gate, up in another.

Each of Qwen3's 28 layers feeds one normed input to q_proj, k_proj and v_proj, and another to
gate_proj and up_proj: five matmuls of ~100-300 rows on the H200, each a 2-6 us cuBLAS
launch (benchmarks/h200/issue5-profile-step.json: ~550 kernels per unmasking forward). Their
weights concatenate into one [q+k+v, hidden] and one [gate+up, hidden] matrix per layer, so a
layer runs three matmul launches fewer. This forward is the backbone's, written out (gpt-fast
style) over the model's own modules: the same RMSNorms, rotary embedding, mask builder and
attention function (sdpa), with use_cache off; only the projections are packed. The packed
weights are the engine's own copies (the shared model is left as it is), about 0.9 GB at
real size in bf16. Exact up to summation order, which fidelity measures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrate.api.technique import Refused, Technique, TechniqueParams
from orchestrate.techniques.omnivoice.use_cache_off import wrapped_too_early

GemmName = Literal["qkv", "o_proj", "gate_up", "down"]  # kernels/small_gemm.OV_SHAPES
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], w [N, K]) -> [M, N]


class GemmParams(BaseModel):
    """One kernels/small_gemm.GemmConfig: tile sizes, K split, warps and stages."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    block_m: Literal[16, 32, 64, 128] = 64
    block_n: Literal[16, 32, 64, 128, 256] = 64
    block_k: Literal[16, 32, 64, 128, 256] = 64
    split_k: int = Field(1, ge=1, le=16)
    num_warps: Literal[1, 2, 4, 8] = 4
    num_stages: int = Field(4, ge=1, le=8)


class PackedParams(TechniqueParams):
    fused_qk_norm_rope: bool = Field(
        False,
        description="q/k RMSNorm + rotary in one Triton kernel per layer, writing attention's "
        "[B, H, S, D] layout (kernels/qk_norm_rope.py; CUDA only, refused elsewhere).",
    )
    fused_qkv_layout: bool = Field(
        False,
        description="With fused_qk_norm_rope: the same launch also writes v, and k and v "
        "repeated to the q heads, so attention (SDPA, called directly) needs none of "
        "repeat_kv's copies.",
    )
    qkv_heads_major: bool = Field(
        False,
        description="With fused_qkv_layout: write q, k, v as contiguous [B, H, S, D] (version "
        "3's layout, kept for A/Bs) instead of tokens-major [B, S, H, D] memory, whose "
        "attention output o_proj reads without a copy.",
    )
    small_gemm: dict[GemmName, GemmParams] = Field(
        default_factory=dict,
        description="These of the layer's four matmuls run kernels/small_gemm.py's split-K "
        "Triton GEMM with the config given (benchmarks/ov_gemm_sweep.py picks them), the "
        "rest cuBLAS. CUDA only, refused elsewhere; a split that leaves a partial K chunk "
        "is refused when applied.",
    )

    @model_validator(mode="after")
    def _layout_needs_the_kernel(self) -> PackedParams:
        if self.fused_qkv_layout and not self.fused_qk_norm_rope:
            raise ValueError(
                "fused_qkv_layout is written by the fused q/k kernel: set fused_qk_norm_rope "
                "too (without it, the modules' path keeps repeat_kv)"
            )
        if self.qkv_heads_major and not self.fused_qkv_layout:
            raise ValueError("qkv_heads_major is fused_qkv_layout's layout: set it too")
        return self


class PackedBackbone:
    """Qwen3Model's forward (no cache) with packed input projections."""

    def __init__(
        self, llm: Any, qk_norm_rope: Any = None, qkv_layout: bool = False,
        tokens_major: bool = False, gemms: dict[str, Gemm] | None = None,
    ):  # fmt: skip
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        cfg = llm.config
        if getattr(cfg, "attention_bias", False) or getattr(llm, "has_sliding_layers", False):
            raise ValueError("packed projections cover Qwen3 without biases or sliding layers")
        self.llm = llm
        self.mask = create_causal_mask
        self.attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            cfg._attn_implementation, sdpa_attention_forward
        )
        self.qkv: list[torch.Tensor] = []
        self.gate_up: list[torch.Tensor] = []
        for layer in llm.layers[: cfg.num_hidden_layers]:
            a, m = layer.self_attn, layer.mlp
            self.qkv.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            self.gate_up.append(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        a0 = llm.layers[0].self_attn
        self.qkv_sizes = [a0.q_proj.out_features, a0.k_proj.out_features, a0.v_proj.out_features]
        self.intermediate = llm.layers[0].mlp.gate_proj.out_features
        self.qk_norm_rope = qk_norm_rope  # the fused kernel's op, or None: the modules' path
        self.qkv_layout = qkv_layout  # the op returns q, k, v with k and v at q's head count
        self.tokens_major = tokens_major  # ... as [B, S, H, D] (else [B, H, S, D])
        self.heads = (self.qkv_sizes[0] // a0.head_dim, self.qkv_sizes[1] // a0.head_dim)
        self.gemms = gemms or {}  # OV_SHAPES name -> its GEMM; any other: F.linear (cuBLAS)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.qkv, *self.gate_up))

    def __call__(self, embeds: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        llm = self.llm
        positions = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
        # The cache goes in by position: transformers renamed it (past_key_values in 5.17,
        # the GPU host's version; cache in 5.24) and keeps it fourth.
        mask = self.mask(llm.config, embeds, attention_mask, None, position_ids=positions)
        cos_sin = llm.rotary_emb(embeds, positions)
        x = embeds
        for i, layer in enumerate(llm.layers[: llm.config.num_hidden_layers]):
            x = x + self.attention(i, layer, layer.input_layernorm(x), mask, cos_sin)
            h = self.linear("gate_up", layer.post_attention_layernorm(x), self.gate_up[i])
            gate, up = h.split(self.intermediate, dim=-1)
            x = x + self.linear("down", layer.mlp.act_fn(gate) * up, layer.mlp.down_proj.weight)
        return llm.norm(x)

    def linear(self, name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w.T (Qwen3's projections have no biases) by the GEMM chosen for `name`."""
        gemm = self.gemms.get(name)
        if gemm is None:
            return F.linear(x, w)
        return gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])

    def attention(
        self, i: int, layer: Any, xn: torch.Tensor, mask: Any, cos_sin: Any
    ) -> torch.Tensor:
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        a = layer.self_attn
        shape = (*xn.shape[:-1], -1, a.head_dim)
        qkv = self.linear("qkv", xn, self.qkv[i])
        if self.qkv_layout:
            q, k, v = self.qk_norm_rope(qkv, a.q_norm.weight, a.k_norm.weight, *cos_sin,
                                        a.q_norm.variance_epsilon, *self.heads)  # fmt: skip
            if self.tokens_major:  # [B, S, H, D] tensors: attention reads them as views
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            # transformers' sdpa_attention_forward, less repeat_kv (k and v come repeated).
            # With tokens-major q, SDPA's output is [B, S, H, D] memory: no copy for o_proj.
            causal = mask is None and q.shape[2] > 1 and getattr(a, "is_causal", True)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=a.scaling, is_causal=causal
            ).transpose(1, 2)
            flat = out.reshape(*xn.shape[:-1], -1).contiguous()
            return self.linear("o_proj", flat, a.o_proj.weight)
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        v = v.view(shape).transpose(1, 2)
        if self.qk_norm_rope is not None:
            q, k = self.qk_norm_rope(qkv, a.q_norm.weight, a.k_norm.weight, *cos_sin,
                                     a.q_norm.variance_epsilon, *self.heads)  # fmt: skip
        else:
            q = a.q_norm(q.view(shape)).transpose(1, 2)
            k = a.k_norm(k.view(shape)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        out, _ = self.attend(a, q, k, v, mask, dropout=0.0, scaling=a.scaling, sliding_window=None)
        return self.linear("o_proj", out.reshape(*xn.shape[:-1], -1).contiguous(), a.o_proj.weight)


def packed_forward(ov: Any, backbone: PackedBackbone):
    C, V = ov.config.num_audio_codebook, ov.config.audio_vocab_size

    def forward(input_ids, audio_mask, attention_mask):
        hidden = backbone(ov._prepare_embed_inputs(input_ids, audio_mask), attention_mask)
        b, s, _ = hidden.shape
        return ov.audio_heads(hidden).view(b, s, C, V).permute(0, 2, 1, 3)

    forward.backbone = backbone  # type: ignore[attr-defined]  # its weights, for memory
    return forward


class PackedProjections(Technique):
    name = "ov_packed_projections"
    family = "omnivoice"
    exact = True
    slots = ("forward",)
    summary = "the backbone's q/k/v and gate/up in one matmul each (3 launches fewer a layer)"
    # 2: the fused_qk_norm_rope param, 3: fused_qkv_layout, 4: its outputs tokens-major
    # (qkv_heads_major: version 3's), 5: ... returned as [B, S, H, D] tensors, not views
    # (4's views were cloned under compile), 6: the small_gemm param; every param off is
    # version 1's forward
    version = 6
    Params = PackedParams

    @classmethod
    def check_stack(cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]):
        return wrapped_too_early(earlier)

    def apply(self, engine: Any) -> None:
        ov = engine.model.ov
        p = self.params
        op = None
        tokens_major = p.fused_qkv_layout and not p.qkv_heads_major
        if p.fused_qk_norm_rope:
            op = fused_qk_norm_rope(ov.llm, p.fused_qkv_layout, tokens_major)
        gemms = small_gemms(ov.llm, p.small_gemm) if p.small_gemm else None
        backbone = PackedBackbone(ov.llm, op, p.fused_qkv_layout, tokens_major, gemms)
        engine.forward = packed_forward(ov, backbone)


def small_gemms(llm: Any, configs: dict[GemmName, GemmParams]) -> dict[str, Gemm]:
    """small_gemm's torch op bound to each configured matmul, or Refused with the reason:
    not on CUDA, or a config whose K split leaves a partial chunk at this model's sizes."""
    import functools

    refuse_off_cuda(llm, "small_gemm")
    from orchestrate.techniques.omnivoice.kernels import small_gemm as sg

    layer = llm.layers[0]
    k = {"qkv": llm.config.hidden_size, "gate_up": llm.config.hidden_size,
         "o_proj": layer.self_attn.o_proj.in_features,
         "down": layer.mlp.down_proj.in_features}  # fmt: skip
    out: dict[str, Gemm] = {}
    for name, params in configs.items():
        cfg = sg.GemmConfig(**params.model_dump())
        if why := sg.split_problem(k[name], cfg):
            raise Refused(f"small_gemm {name}: {why}")
        out[name] = functools.partial(sg.small_gemm_op, config=cfg)
    return out


def refuse_off_cuda(llm: Any, what: str) -> None:
    """Refused unless the model is on CUDA and triton is installed: the kernels' need."""
    import importlib.util

    if llm.device.type != "cuda" or importlib.util.find_spec("triton") is None:
        raise Refused(f"{what} needs CUDA and triton (the model is on {llm.device})")


def fused_qk_norm_rope(llm: Any, qkv_layout: bool = False, tokens_major: bool = True) -> Any:
    """The fused kernel's torch op for this backbone, or Refused with the reason."""
    a = llm.layers[0].self_attn
    refuse_off_cuda(llm, "fused_qk_norm_rope")
    if a.q_norm.variance_epsilon != a.k_norm.variance_epsilon:
        raise Refused("fused_qk_norm_rope: the q and k norms have different eps")
    from orchestrate.techniques.omnivoice.kernels import qk_norm_rope as kernels

    return kernels.qkv_norm_rope_op(tokens_major) if qkv_layout else kernels.qk_norm_rope_op()
