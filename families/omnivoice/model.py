"""OmniVoice through the real `omnivoice` package: `OmniVoice.from_pretrained(folder)`.

Random weights: the preset's architecture (Qwen3 backbone + 8 x 1025 audio embeddings and
heads, a Higgs audio tokenizer codec, a locally trained byte-level BPE tokenizer with the 7
special tokens the prompt format uses) is built with a fixed seed, saved with
save_pretrained into a cache folder keyed by its config hash, and loaded back through the
package's own loader, so every stack runs the package's code path. Real weights load from
a local folder or the HF cache only; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from orchestrate.api.config import ModelSpec
from orchestrate.api.family import configs_hash, seed_codebooks
from orchestrate.families.omnivoice.presets import (
    AUDIO_VOCAB,
    MASK_ID,
    NUM_CODEBOOKS,
    PRESETS,
    OmniVoicePreset,
)

# The prompt format's specials (see OmniVoice._prepare_inference_inputs): each must be one
# token, or the style and text spans the model was trained on would not be recognised.
SPECIAL_TOKENS = (
    "<|denoise|>",
    "<|lang_start|>",
    "<|lang_end|>",
    "<|instruct_start|>",
    "<|instruct_end|>",
    "<|text_start|>",
    "<|text_end|>",
)
CACHE_ENV = "ORCHESTRATE_CACHE"  # default ~/.cache/orchestrate
# bump when the saved folder's layout or contents change (2: seeded codec codebooks)
BUILD_VERSION = 2


class WeightsError(RuntimeError):
    """Weights were asked for and cannot be found or are not an OmniVoice checkpoint."""


@dataclass
class OmniVoiceModel:
    ov: Any  # omnivoice.OmniVoice, loaded by its from_pretrained (tokenizers attached)
    preset: str
    folder: Path
    random_weights: bool

    @property
    def device(self) -> torch.device:
        return self.ov.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ov.dtype

    @property
    def sample_rate(self) -> int:
        return int(self.ov.sampling_rate)

    @property
    def frame_rate(self) -> int:
        return int(self.ov.audio_tokenizer.config.frame_rate)

    def config_hash(self) -> str:
        return configs_hash(lm=self.ov.config, codec=self.ov.audio_tokenizer.config)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_model(spec: ModelSpec) -> OmniVoiceModel:
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but no CUDA device is available here")
    if spec.weights:
        return load(_resolve_folder(spec.weights, spec.revision), spec, random_weights=False)
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown omnivoice preset {spec.preset!r}; known: {sorted(PRESETS)}")
    preset = PRESETS[spec.preset]
    folder = random_folder(preset, spec.init_seed)
    return load(folder, spec, random_weights=True, preset=preset.name)


def load(
    folder: Path, spec: ModelSpec, random_weights: bool, preset: str | None = None
) -> OmniVoiceModel:
    from omnivoice import OmniVoice

    if not (folder / "config.json").exists():
        raise WeightsError(f"{folder}: no config.json (expected an OmniVoice checkpoint folder)")
    if not (folder / "audio_tokenizer" / "config.json").exists():
        # from_pretrained would fetch eustlb/higgs-audio-v2-tokenizer from the Hub instead.
        raise WeightsError(
            f"{folder}: no audio_tokenizer/ subfolder (the Higgs audio tokenizer); "
            "no download is attempted"
        )
    # sdpa: `eager` silently mis-handles the bool 4D mask, flex aborts on the CPU.
    ov = OmniVoice.from_pretrained(
        str(folder), dtype=_dtype(spec.dtype), attn_implementation="sdpa", local_files_only=True
    )
    ov = ov.to(spec.device).eval()
    ov.audio_tokenizer.to(spec.device)  # loaded on the model's device at load time (cpu)
    return OmniVoiceModel(
        ov=ov,
        preset=preset or f"weights:{folder.name}",
        folder=folder,
        random_weights=random_weights,
    )


def _resolve_folder(weights: str, revision: str | None) -> Path:
    path = Path(weights).expanduser()
    if path.is_dir():
        return path
    try:  # an HF repo id (e.g. k2-fsa/OmniVoice) already in the local cache; never a download
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(weights, revision=revision, local_files_only=True))
    except Exception as exc:
        raise WeightsError(
            f"weights {weights!r} are neither a local folder nor in the HF cache "
            f"(revision {revision or 'any'}); no download is attempted: {exc}"
        ) from exc


# --------------------------------------------------------------- random-weight folders


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, "~/.cache/orchestrate")).expanduser() / "omnivoice"


def random_folder(preset: OmniVoicePreset, seed: int) -> Path:
    """The saved random-weight checkpoint for (preset, seed), built once and reused."""
    key = json.dumps(
        {"v": BUILD_VERSION, "llm": preset.llm, "codec": preset.codec, "bpe": preset.bpe_vocab},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_root() / f"{preset.name}-s{seed}-{digest}"
    if (folder / "DONE").exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    save_random(preset, seed, tmp)
    (tmp / "DONE").write_text("complete\n")
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: theirs is the same build
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def save_random(preset: OmniVoicePreset, seed: int, folder: Path) -> Path:
    """Seeded random OmniVoice + codec + tokenizer in the layout from_pretrained reads."""
    from omnivoice import OmniVoice, OmniVoiceConfig
    from transformers import (
        DacFeatureExtractor,
        HiggsAudioV2TokenizerConfig,
        HiggsAudioV2TokenizerModel,
        Qwen3Config,
    )

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    llm_cfg = Qwen3Config(**preset.llm)
    llm_cfg._attn_implementation = "sdpa"
    cfg = OmniVoiceConfig(
        audio_vocab_size=AUDIO_VOCAB,
        audio_mask_id=MASK_ID,
        num_audio_codebook=NUM_CODEBOOKS,
        llm_config=llm_cfg,
    )
    OmniVoice(cfg).save_pretrained(folder)
    codec_cfg = HiggsAudioV2TokenizerConfig(**preset.codec)
    if codec_cfg.frame_rate != 25 or codec_cfg.num_quantizers != NUM_CODEBOOKS:
        raise ValueError(
            f"preset {preset.name!r}: codec runs at {codec_cfg.frame_rate} fps with "
            f"{codec_cfg.num_quantizers} quantizers; OmniVoice needs 25 fps and 8"
        )
    codec = HiggsAudioV2TokenizerModel(codec_cfg)
    seed_codebooks(codec)  # else every code decodes to zeros: audio blind to its codes
    # Decoding is quantizer -> fc2 -> acoustic_decoder. With PyTorch's default (random)
    # biases there, the random decoder's output is a pattern of its biases: with seeded
    # codebooks alone two seeds' clips on the tiny preset still correlated above 0.9999 (a
    # one-off check while diagnosing), past the worker's same-audio threshold of 0.999; with
    # these zeroed, 0.11-0.36 (benchmarks/cpu/random-audio-check-omnivoice-tiny.json).
    with torch.no_grad():
        for part in (codec.fc2, codec.acoustic_decoder):
            for name, param in part.named_parameters():
                if name.endswith("bias"):
                    param.zero_()
    codec.save_pretrained(folder / "audio_tokenizer")
    DacFeatureExtractor(
        sampling_rate=codec_cfg.sample_rate, hop_length=codec_cfg.hop_length
    ).save_pretrained(folder / "audio_tokenizer")
    build_tokenizer(preset.bpe_vocab).save_pretrained(folder)
    return folder


# A fixed training text: the tokenizer must be identical on every machine and every run.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Please remember to water the plants. "
    "She opened the letter slowly, unsure whether she wanted to know what it said. "
    "Turn left at the second traffic light and the museum will be on your right. "
    "Numbers: 0 1 2 3 4 5 6 7 8 9. Punctuation: , . ; : ! ? ' \" ( ) - [laughter] [sigh]. "
    "None female male child teenager young adult middle-aged elderly whisper accent pitch "
    "american british australian indian low high moderate very english chinese en zh"
)


def build_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE (any text encodes) with OmniVoice's 7 specials as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", *SPECIAL_TOKENS],
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS),
    )
