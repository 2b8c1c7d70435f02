"""Architecture presets. 'omnivoice' is the real OmniVoice 0.2.1 shape (612.6M backbone +
heads, 200.3M codec); 'tiny' keeps every structural choice (8 codebooks x 1025, Qwen3
backbone, Higgs codec at 25 fps with 8 quantizers) at a size two CPU cores run in seconds.

Plain dicts only: this module must import without `omnivoice` (the CPU venv may lack it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NUM_CODEBOOKS = 8
AUDIO_VOCAB = 1025  # 1024 codes + the mask id
MASK_ID = 1024


@dataclass(frozen=True)
class OmniVoicePreset:
    name: str
    llm: dict[str, Any]  # a transformers Qwen3Config (headless Qwen3Model backbone)
    codec: dict[str, Any]  # a transformers HiggsAudioV2TokenizerConfig
    bpe_vocab: int  # byte-level BPE tokenizer size before the specials (random weights)


# The codec values transformers' defaults get wrong for OmniVoice (75 fps, 5 quantizers):
# hop 8*5*4*2*3 = 960 at 24 kHz is 25 fps; 2 kbps / (25 fps * 10 bits) = 8 quantizers.
_CODEC_RATE = dict(
    sample_rate=24_000,
    target_bandwidths=[0.5, 1, 1.5, 2],
    codebook_size=1024,
    semantic_sample_rate=16_000,
    downsample_factor=320,
)

OMNIVOICE = OmniVoicePreset(
    name="omnivoice",
    llm=dict(
        vocab_size=151_676,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=40_960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_cache=True,  # as Qwen3-0.6B ships it; `use_cache_off` turns it off
    ),
    codec=dict(
        **_CODEC_RATE,
        codebook_dim=64,
        acoustic_model_config=dict(
            model_type="dac",
            encoder_hidden_size=64,
            downsampling_ratios=[8, 5, 4, 2, 3],
            decoder_hidden_size=1024,
            upsampling_ratios=[8, 5, 4, 2, 3],
            hidden_size=256,
        ),
        semantic_model_config=dict(model_type="hubert", mask_time_prob=0.0),
    ),
    bpe_vocab=4096,  # the real checkpoint ships Qwen's tokenizer; see model.py
)

TINY = OmniVoicePreset(
    name="tiny",
    llm=dict(
        vocab_size=2048,  # >= 1025: the package pads with the audio mask id in text rows
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_cache=True,
    ),
    codec=dict(
        **_CODEC_RATE,
        codebook_dim=8,
        acoustic_model_config=dict(
            model_type="dac",
            encoder_hidden_size=4,
            downsampling_ratios=[8, 5, 4, 2, 3],
            decoder_hidden_size=64,  # halved per upsampling stage: 5 stages -> 2
            upsampling_ratios=[8, 5, 4, 2, 3],
            hidden_size=16,
        ),
        semantic_model_config=dict(
            model_type="hubert",
            mask_time_prob=0.0,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=[16] * 7,
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
        ),
    ),
    bpe_vocab=1500,
)

PRESETS: dict[str, OmniVoicePreset] = {p.name: p for p in (OMNIVOICE, TINY)}
