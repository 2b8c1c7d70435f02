"""Architecture presets. 'rumik-oss-1' is the real shape (3.38B); 'tiny' is the same
architecture at a few million parameters for two CPU cores."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrate.families.rumik.vocab import AudioVocab

_REAL_FIRST_UNIT = 261_008


@dataclass(frozen=True)
class RumikPreset:
    name: str
    lm: dict[str, Any]
    mimi: dict[str, Any]
    vocab: AudioVocab
    stop_hidden: int
    voices: tuple[str, ...] = ("Ira", "Aisha", "Siya", "Zoya")
    extra: dict[str, Any] = field(default_factory=dict)


def _layer_types(n_blocks: int) -> list[str]:
    return (["sliding_attention"] * 3 + ["full_attention"]) * n_blocks


RUMIK_OSS_1 = RumikPreset(
    name="rumik-oss-1",
    lm=dict(
        vocab_size=277_404,
        hidden_size=2048,
        intermediate_size=11_008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        hidden_act="silu",
        layer_norm_eps=1e-5,
        logit_scale=1.0,
        sliding_window=4096,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        layer_types=_layer_types(9),
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    ),
    mimi=dict(num_quantizers=8),
    vocab=AudioVocab(
        first_unit_id=_REAL_FIRST_UNIT,
        codebook_size=2048,
        num_quantizers=8,
        end_id=_REAL_FIRST_UNIT + 16_384,
        vocab_size=277_404,
    ),
    stop_hidden=512,
)

_TINY_FIRST_UNIT = 512
TINY = RumikPreset(
    name="tiny",
    lm=dict(
        vocab_size=_TINY_FIRST_UNIT + 8 * 64 + 12,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_act="silu",
        layer_norm_eps=1e-5,
        logit_scale=1.0,
        sliding_window=64,  # small so tests exercise the window
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        layer_types=_layer_types(1),
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    ),
    mimi=dict(
        num_quantizers=8,
        codebook_size=64,
        codebook_dim=16,
        vector_quantization_hidden_dimension=16,
        hidden_size=32,
        num_filters=4,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        upsample_groups=32,
    ),
    vocab=AudioVocab(
        first_unit_id=_TINY_FIRST_UNIT,
        codebook_size=64,
        num_quantizers=8,
        end_id=_TINY_FIRST_UNIT + 512,
        vocab_size=_TINY_FIRST_UNIT + 8 * 64 + 12,
    ),
    stop_hidden=32,
)

# tiny's shape with the real head_dim (128): what the Triton kernels need, for GPU tests.
SMALL_128 = RumikPreset(
    name="small-128",
    lm={
        **TINY.lm,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
    mimi=TINY.mimi,
    vocab=TINY.vocab,
    stop_hidden=256,
)

PRESETS: dict[str, RumikPreset] = {p.name: p for p in (RUMIK_OSS_1, TINY, SMALL_128)}
