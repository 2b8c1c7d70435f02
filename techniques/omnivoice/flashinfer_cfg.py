"""FlashInfer packed CFG forward: the backbone over each row's valid tokens only.

slot_loop's forward receives a padded CFG batch: B conditioned rows (length c_len) and B
unconditioned rows (length t_len) padded to S = max c_len, with a bool block mask. This
forward packs each row's valid positions (no padding) into one [N, hidden] sequence with
per-row offsets (indptr), runs the package's own Qwen3 modules on it (RMSNorm, q/k/v
projections, q_norm/k_norm, RoPE, o_proj, SwiGLU MLP, final norm) with non-causal
attention inside each row, and runs the audio heads (hidden -> 8 x 1025) only on the
positions slot_loop reads: c_len-t_len:c_len of cond rows and :t_len of uncond rows.

Positions: OmniVoice.forward passes position_ids=None, so Qwen3Model uses arange(S) for
every row (rows are left-aligned, no cache): a row's token j has position j. Packed tokens
therefore get positions restarting at 0 per row. Padded positions never reach a valid one
in the package (the block mask), so removing them is the same math.

Output contract: logits [R, C, S, V] like the package's; positions slot_loop never reads
(padding, and the text/reference prefix of cond rows) are ZERO, not logits.

Backends (param `backend`): "flashinfer" runs BatchPrefillWithRaggedKVCacheWrapper
(causal=False, GQA), planned once per batch layout and reused across layers and steps;
"torch" runs scaled_dot_product_attention per row segment (CPU-capable; the tests use it to
prove the packing exact). Row lengths are read from the attention mask once per synthesis
(one host sync); later steps find the layout by the mask's address (see LayoutCache).
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from orchestrate.api.technique import Refused, Technique, TechniqueParams, UnsupportedConfig
from orchestrate.techniques.omnivoice.use_cache_off import wrapped_too_early

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # FlashInfer's prefill kernels' head_dim instances
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)


class FlashInferPackedCFGParams(TechniqueParams):
    backend: Literal["flashinfer", "torch"] = Field(
        "flashinfer", description="attention over the packed rows: FlashInfer ragged or SDPA"
    )
    kernel: Literal["auto", "fa2", "fa3"] = Field(
        "auto", description="FlashInfer's kernel family (flashinfer backend only)"
    )


# ------------------------------------------------------------------- batch layout


@dataclass
class Layout:
    """Where each row's valid tokens sit in the packed sequence, and what slot_loop reads."""

    indptr: list[int]  # packed offsets per row, [R + 1]
    gather: torch.Tensor  # [N] index into the flattened [R * S] of each packed token
    positions: torch.Tensor  # [1, N] RoPE position of each packed token
    read_packed: torch.Tensor  # [M] packed index of each position slot_loop reads
    read_flat: torch.Tensor  # [M] index into [R * S] of the same positions
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [N, D], first forward
    wrapper: Any = None  # FlashInfer wrapper planned for this layout


def row_lengths(mask: torch.Tensor) -> list[int]:
    """Valid length per row from its first query row; checks the mask is the CFG block
    mask, which packing relies on (one host sync, once per synthesis)."""
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError(f"expected a bool [R, 1, S, S] mask, got {mask.dtype} {mask.shape}")
    m = mask[:, 0]
    lens = m[:, 0, :].sum(-1)
    valid = torch.arange(m.shape[-1], device=m.device)[None, :] < lens[:, None]  # [R, S]
    q, k = valid[:, :, None], valid[:, None, :]
    # Valid queries see exactly the valid keys; padding queries see no valid key.
    block = torch.where(q, m == k, ~(m & k)).all()
    if not bool(block):
        raise ValueError("attention mask is not a per-row non-causal block mask; cannot pack")
    return [int(n) for n in lens.tolist()]


def read_spans(lens: list[int], rows: int) -> list[tuple[int, int]]:
    """Positions slot_loop reads per row, from the full 2B batch's lengths; a batch that
    is not CFG-shaped (uncond row longer than its cond row) gets every valid position."""
    b = len(lens) // 2
    cfg = len(lens) % 2 == 0 and all(t <= c for c, t in zip(lens[:b], lens[b:], strict=True))
    if not cfg:
        return [(0, n) for n in lens[:rows]]
    return [(lens[r] - lens[b + r], lens[r]) if r < b else (0, lens[r]) for r in range(rows)]


def build_layout(lens: list[int], rows: int, seq: int, device: torch.device) -> Layout:
    row_lens = lens[:rows]
    indptr = [0, *itertools.accumulate(row_lens)]
    spans = read_spans(lens, rows)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).to(device, non_blocking=True)

    return Layout(
        indptr=indptr,
        gather=cat([torch.arange(n) + r * seq for r, n in enumerate(row_lens)]),
        positions=cat([torch.arange(n) for n in row_lens])[None],
        read_packed=cat([torch.arange(a, b) + indptr[r] for r, (a, b) in enumerate(spans)]),
        read_flat=cat([torch.arange(a, b) + r * seq for r, (a, b) in enumerate(spans)]),
    )


def whole_mask(mask: torch.Tensor) -> torch.Tensor:
    """All rows of the tensor `mask` was sliced from: slot_loop passes mask[:rows] of one
    contiguous [2B, 1, S, S] mask, and inference-mode views keep no `_base`, so the rows
    are recovered from the storage (which holds exactly the 2B rows)."""
    if not mask.is_contiguous() or mask.storage_offset() != 0:
        return mask
    rows = mask.untyped_storage().nbytes() // (mask.stride(0) * mask.element_size())
    return mask.as_strided((rows, *mask.shape[1:]), mask.stride())


@dataclass
class LayoutCache:
    """Layouts of the current synthesis, keyed by row count (2B with CFG, B without).

    A synthesis is told apart by its mask's address, with no host sync: the cache holds
    that mask, so no other mask can be allocated there while it is current. Assumes, as
    slot_loop does, that a mask is not rewritten in place between forwards.
    """

    mask: torch.Tensor | None = None  # the whole mask of the current synthesis (held)
    lens: list[int] = field(default_factory=list)
    by_rows: dict[int, Layout] = field(default_factory=dict)

    def layout(self, mask: torch.Tensor) -> Layout:
        held = self.mask
        if (
            held is None
            or held.data_ptr() != mask.data_ptr()
            or held.shape[1:] != mask.shape[1:]
            or held.stride() != mask.stride()
        ):
            self.mask = whole_mask(mask)
            self.lens, self.by_rows = row_lengths(self.mask), {}
        rows = mask.shape[0]
        if rows not in self.by_rows:
            self.by_rows[rows] = build_layout(self.lens, rows, mask.shape[-1], mask.device)
        return self.by_rows[rows]


# ------------------------------------------------------------------- attention backends


def torch_attend(layout: Layout, q, k, v, scale: float) -> torch.Tensor:
    """SDPA per packed row segment ([L, H, D] -> [1, H, L, D]); no mask: no padding."""
    outs = []
    for a, b in itertools.pairwise(layout.indptr):
        o = F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), scale=scale, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def flashinfer_attend(layout: Layout, q, k, v, scale: float) -> torch.Tensor:
    """FlashInfer's ragged prefill. Its kernels are not torch ops: packed_forward runs it
    under torch.compiler.disable, applied there rather than here because the decorator
    imports dynamo (about 2 s) and every command loads this module to list techniques."""
    return layout.wrapper.run(q, k, v)


class FlashInferPlanner:
    """One ragged-prefill wrapper per row count, sharing one float workspace; `plan` runs
    once per layout (a new synthesis or a new row count), never per step or layer."""

    def __init__(self, device: torch.device, kernel: str):
        import flashinfer

        self.flashinfer, self.kernel = flashinfer, kernel
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrappers: dict[int, Any] = {}

    def plan(self, layout: Layout, attn: Any, dtype: torch.dtype) -> None:
        rows = len(layout.indptr) - 1
        if rows not in self.wrappers:
            self.wrappers[rows] = self.flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                self.workspace, "NHD", backend=self.kernel
            )
        wrapper = self.wrappers[rows]
        indptr = torch.tensor(layout.indptr, dtype=torch.int32)
        cfg = attn.config
        wrapper.plan(
            indptr, indptr, cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim,
            causal=False, sm_scale=attn.scaling, q_data_type=dtype, kv_data_type=dtype,
        )  # fmt: skip
        layout.wrapper = wrapper


# ------------------------------------------------------------------- the forward


def attention(attn: Any, x: torch.Tensor, layout: Layout, attend: Any) -> torch.Tensor:
    """Qwen3Attention.forward on packed tokens [N, hidden], same modules and order."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    n, d = x.shape[0], attn.head_dim
    q = attn.q_norm(attn.q_proj(x).view(n, -1, d))
    k = attn.k_norm(attn.k_proj(x).view(n, -1, d))
    v = attn.v_proj(x).view(n, -1, d)
    cos, sin = layout.rope
    q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # cos [N, D] -> [N, 1, D]
    return attn.o_proj(attend(layout, q, k, v, attn.scaling).reshape(n, -1))


def packed_forward(ov: Any, backend: str = "torch", kernel: str = "auto"):
    """The `forward` slot over packed tokens (see the module docstring for the contract)."""
    C, V = ov.config.num_audio_codebook, ov.config.audio_vocab_size
    llm = ov.llm
    layers = llm.layers[: llm.config.num_hidden_layers]
    cache = LayoutCache()
    planner = FlashInferPlanner(ov.device, kernel) if backend == "flashinfer" else None
    # eager under dynamo: FlashInfer's kernels are not torch ops
    attend = torch.compiler.disable(flashinfer_attend) if backend == "flashinfer" else torch_attend

    dtype = llm.embed_tokens.weight.dtype  # the embeddings' dtype, which RoPE's cos/sin take

    @torch.compiler.disable  # host-side bookkeeping, once per new layout: out of any graph
    def layout_for(mask: torch.Tensor) -> Layout:
        layout = cache.layout(mask)
        if layout.rope is None:  # the package's rotary module at the packed positions
            cos, sin = llm.rotary_emb(
                torch.empty(0, dtype=dtype, device=mask.device), layout.positions
            )
            layout.rope = (cos[0], sin[0])
            if planner is not None:
                planner.plan(layout, layers[0].self_attn, dtype)
        return layout

    def forward(input_ids, audio_mask, attention_mask):
        R, _, S = input_ids.shape
        layout = layout_for(attention_mask)
        ids = input_ids.transpose(0, 1).reshape(C, R * S).index_select(1, layout.gather)
        amask = audio_mask.reshape(R * S).index_select(0, layout.gather)
        x = ov._prepare_embed_inputs(ids[None], amask[None])[0]  # [N, hidden]
        for layer in layers:
            x = x + attention(layer.self_attn, layer.input_layernorm(x), layout, attend)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        # The final RMSNorm and the heads are per token: only the positions slot_loop reads.
        x = llm.norm(x.index_select(0, layout.read_packed))
        out = x.new_zeros(R * S, C * V)
        out.index_copy_(0, layout.read_flat, ov.audio_heads(x))
        return out.view(R, S, C, V).permute(0, 2, 1, 3)

    forward.cache = cache  # type: ignore[attr-defined]
    return forward


# ------------------------------------------------------------------- the technique


def unsupported_backbone(ov: Any) -> str | None:
    cfg = ov.llm.config
    kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"packs full-attention layers only; backbone has {sorted(kinds)}"
    return None


def flashinfer_missing(device: torch.device, head_dim: int) -> tuple[str | None, bool]:
    """(why FlashInfer cannot run here, whether it is a shape limit) or (None, False)."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"FlashInfer needs a CUDA GPU; the model is on {device.type}")
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append("the package 'flashinfer' is not installed (pip install flashinfer-python)")
    elif device.type == "cuda":
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # a broken install is a refusal too, with its cause
            reasons.append(f"flashinfer does not import: {type(exc).__name__}: {exc}")
    if reasons:
        return "; ".join(reasons) + " (backend 'torch' runs without it)", False
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"FlashInfer prefill supports head_dim {FLASHINFER_HEAD_DIMS}, not {head_dim}", True
    return None, False


class FlashInferPackedCFG(Technique):
    name = "flashinfer_packed_cfg"
    family = "omnivoice"
    exact = True  # same math, padding removed; the torch backend is checked at fp32 on CPU
    slots = ("forward",)
    # Not static requires: backend 'torch' runs on the CPU; backend 'flashinfer' checks
    # cuda + package at apply and is refused with the reason, as the issue asks.
    requires = ()
    summary = "forward over packed CFG rows (no padding), heads only where read; FlashInfer"
    Params = FlashInferPackedCFGParams

    @classmethod
    def check_stack(cls, params: TechniqueParams, earlier: dict[str, TechniqueParams]):
        return wrapped_too_early(earlier)

    def apply(self, engine: Any) -> None:
        ov = engine.model.ov
        if why := unsupported_backbone(ov):
            raise UnsupportedConfig(why)
        if self.params.backend == "flashinfer":
            why, shape_limit = flashinfer_missing(ov.device, ov.llm.layers[0].self_attn.head_dim)
            if why:
                raise (UnsupportedConfig if shape_limit else Refused)(why)
        engine.forward = packed_forward(ov, self.params.backend, self.params.kernel)
