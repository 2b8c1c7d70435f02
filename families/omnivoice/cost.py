"""The least one OmniVoice forward must move and compute: the per-step floor.

One unmasking step is one forward of the backbone and the audio heads over the CFG batch
(R rows of S positions; R = 2B, or B once CFG is off). At batch 1 and a few hundred
positions it must read every layer weight and the heads once (bytes), and it does
2 x params x R x S matmul FLOPs plus 4 x S^2 x (heads x head_dim) per row and layer for
attention (QK^T and PV; the mask is full and bidirectional). The floor of a step is the
larger of bytes / copy bandwidth and FLOPs / measured matmul throughput.
"""

from __future__ import annotations

from typing import Any


def forward_cost(ov: Any, rows: float, seq: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one forward over `rows` sequences of `seq` positions."""
    cfg = ov.config.llm_config
    layer_params = sum(p.numel() for p in ov.llm.layers[0].parameters())
    heads = ov.audio_heads.weight.numel()
    itemsize = ov.audio_heads.weight.element_size()
    n_layers = cfg.num_hidden_layers
    weight_bytes = (layer_params * n_layers + heads) * itemsize
    tokens = rows * seq
    attn_width = cfg.num_attention_heads * cfg.head_dim
    flops = 2 * (layer_params * n_layers + heads) * tokens
    flops += 4 * rows * seq * seq * attn_width * n_layers
    return float(weight_bytes), float(flops)
