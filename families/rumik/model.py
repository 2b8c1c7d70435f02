"""Rumik OSS 1 as three real modules: Cohere2ForCausalLM, a stop head, and a Mimi decoder.

`build_model` makes the real architecture from a preset with random weights (seeded, so
every stack in a comparison gets the same model) or loads real weights from a local folder
or the HF cache. Nothing here downloads: missing weights are a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from orchestrate.api.config import ModelSpec
from orchestrate.api.family import configs_hash, seed_codebooks
from orchestrate.families.rumik.presets import PRESETS, RumikPreset
from orchestrate.families.rumik.vocab import AudioVocab, ByteTokenizer

if TYPE_CHECKING:  # transformers (2 s, its modelling code 5 s more) loads when a model is built
    from transformers import Cohere2Config, Cohere2ForCausalLM, MimiModel

LAYOUT_FILE = "rumik_layout.json"  # our marker: vocab layout + which tokenizer to use
STOP_HEAD_PREFIX = "stop_predictor."


class WeightsError(RuntimeError):
    """Weights were asked for and cannot be found or do not fit the architecture."""


class StopHead(nn.Sequential):
    """LayerNorm -> Linear(h, h/4) -> GELU -> Linear(., 1) on the last normed hidden state.

    Index names match upstream's nn.Sequential (stop_predictor.0/.1/.3), so its state dict
    loads unchanged.
    """

    def __init__(self, hidden: int, mid: int):
        super().__init__(nn.LayerNorm(hidden), nn.Linear(hidden, mid), nn.GELU(), nn.Linear(mid, 1))


@dataclass
class RumikModel:
    lm: Cohere2ForCausalLM
    stop_head: StopHead
    codec: MimiModel
    vocab: AudioVocab
    tokenizer: Any  # .encode(str) -> list[int]
    voices: tuple[str, ...]
    preset: str
    random_weights: bool

    @property
    def device(self) -> torch.device:
        return self.lm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype

    @property
    def config(self) -> Cohere2Config:
        return self.lm.config

    def config_hash(self) -> str:
        return configs_hash(lm=self.lm.config, codec=self.codec.config)

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        return list(ids.input_ids if hasattr(ids, "input_ids") else ids)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_model(spec: ModelSpec) -> RumikModel:
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but no CUDA device is available here")
    if spec.weights:
        return load_pretrained(spec.weights, spec)
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown rumik preset {spec.preset!r}; known: {sorted(PRESETS)}")
    return build_random(PRESETS[spec.preset], spec)


def build_random(preset: RumikPreset, spec: ModelSpec) -> RumikModel:
    """The preset's real architecture with seeded random weights, built on the target device.

    Initialising on the device (not on the CPU first) keeps a 3.38B build to seconds.
    """
    from transformers import Cohere2ForCausalLM, MimiConfig, MimiModel

    torch.manual_seed(spec.init_seed)
    device = torch.device(spec.device)
    dtype = _dtype(spec.dtype)
    with device:
        lm = Cohere2ForCausalLM(_lm_config(preset)).to(dtype=dtype).eval()
        stop = StopHead(preset.lm["hidden_size"], preset.stop_hidden).to(dtype=dtype).eval()
        # Mimi stays fp32, as upstream runs it; its decode is a small share of the time.
        codec = MimiModel(MimiConfig(**preset.mimi)).eval()
        seed_codebooks(codec)  # else every code decodes to zeros: audio blind to its codes
    pack_input_projections(lm)
    return RumikModel(
        lm=lm,
        stop_head=stop,
        codec=codec,
        vocab=preset.vocab,
        tokenizer=ByteTokenizer(preset.vocab),
        voices=preset.voices,
        preset=preset.name,
        random_weights=True,
    )


def input_projections(layer: nn.Module) -> list[nn.Linear]:
    """The five projections LN(x) feeds in a Cohere2 parallel block, in packing order."""
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj]


@torch.no_grad()
def pack_input_projections(lm: Cohere2ForCausalLM) -> None:
    """Lay each block's five input projection weights out as consecutive row ranges of one
    [q+k+v+gate+up, hidden] tensor, each Linear's weight a view of its range.

    Why: a packed projection (packed_projections, batched_decode) then reads the tensor the
    model already holds (`packed_input_weight`) instead of a copy (3.7 GB at real size, room
    a serving cache wants). Each view is contiguous, with the shape and strides its weight
    had, so stock reads it as before. Done as the model is built, before any engine exists:
    a CUDA graph captured on the old tensors would read freed memory after a repack.
    """
    for layer in lm.model.layers:
        parts = input_projections(layer)
        packed = torch.cat([p.weight for p in parts])
        start = 0
        for p in parts:
            rows = p.weight.shape[0]
            p.weight.data = packed[start : start + rows]
            start += rows


def packed_input_weight(layer: nn.Module) -> torch.Tensor | None:
    """The one tensor [q+k+v+gate+up, hidden] a block's input projections are views of
    (pack_input_projections), or None when they are not (a weight replaced since)."""
    weights = [p.weight for p in input_projections(layer)]
    first = weights[0]
    hidden, offset = first.shape[1], first.storage_offset()
    for w in weights:
        same_storage = w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_storage and w.is_contiguous() and w.storage_offset() == offset):
            return None
        if w.shape[1] != hidden or w.dtype != first.dtype:
            return None
        offset += w.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, hidden), (hidden, 1), first.storage_offset())


def _lm_config(preset: RumikPreset) -> Cohere2Config:
    from transformers import Cohere2Config

    cfg = Cohere2Config(**preset.lm)
    cfg._attn_implementation = "sdpa"
    return cfg


# ---------------------------------------------------------------------- save / load


def save_pretrained(model: RumikModel, folder: str | Path) -> Path:
    """Write a checkpoint `load_pretrained` reads (used by tests and for sharing models)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    # Each tensor its own storage: transformers keeps one of several tensors sharing one
    # (pack_input_projections' views) and drops the rest.
    state = {k: v.clone() for k, v in model.lm.state_dict().items()}
    model.lm.save_pretrained(folder, state_dict=state)
    stop = {STOP_HEAD_PREFIX + k: v.contiguous() for k, v in model.stop_head.state_dict().items()}
    save_file(stop, str(folder / "stop_head.safetensors"))
    model.codec.save_pretrained(folder / "mimi")
    layout = {
        "first_unit_id": model.vocab.first_unit_id,
        "codebook_size": model.vocab.codebook_size,
        "num_quantizers": model.vocab.num_quantizers,
        "audio_end_token_id": model.vocab.end_id,
        "tokenizer": "byte" if isinstance(model.tokenizer, ByteTokenizer) else "auto",
        "voices": list(model.voices),
        "stop_hidden": model.stop_head[1].out_features,
    }
    (folder / LAYOUT_FILE).write_text(json.dumps(layout, indent=2))
    return folder


def _resolve_folder(weights: str, revision: str | None) -> Path:
    path = Path(weights).expanduser()
    if path.is_dir():
        return path
    try:  # an HF repo id that is already in the local cache; never a download
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(weights, revision=revision, local_files_only=True))
    except Exception as exc:
        raise WeightsError(
            f"weights {weights!r} are neither a local folder nor in the HF cache "
            f"(revision {revision or 'any'}); no download is attempted: {exc}"
        ) from exc


def load_pretrained(weights: str, spec: ModelSpec) -> RumikModel:
    from safetensors import safe_open
    from transformers import Cohere2ForCausalLM

    folder = _resolve_folder(weights, spec.revision)
    if not (folder / "config.json").exists():
        raise WeightsError(f"{folder}: no config.json (expected a save_pretrained folder)")
    layout = _read_layout(folder)
    dtype = _dtype(spec.dtype)
    lm = Cohere2ForCausalLM.from_pretrained(
        folder, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    lm = lm.to(spec.device).eval()
    pack_input_projections(lm)

    stop_state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith(STOP_HEAD_PREFIX):
                    stop_state[key.removeprefix(STOP_HEAD_PREFIX)] = sf.get_tensor(key)
    if not stop_state:
        raise WeightsError(f"{folder}: no '{STOP_HEAD_PREFIX}*' tensors in any *.safetensors")
    hidden = lm.config.hidden_size
    stop = StopHead(hidden, layout.get("stop_hidden", stop_state["1.weight"].shape[0]))
    stop.load_state_dict(stop_state)
    stop = stop.to(device=spec.device, dtype=dtype).eval()

    codec = _load_codec(folder).to(spec.device).eval()
    vocab = AudioVocab(
        first_unit_id=layout["first_unit_id"],
        codebook_size=layout["codebook_size"],
        num_quantizers=layout["num_quantizers"],
        end_id=layout["audio_end_token_id"],
        vocab_size=lm.config.vocab_size,
    )
    if layout.get("tokenizer") == "byte":
        tokenizer: Any = ByteTokenizer(vocab)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return RumikModel(
        lm=lm,
        stop_head=stop,
        codec=codec,
        vocab=vocab,
        tokenizer=tokenizer,
        voices=tuple(layout.get("voices", ("Ira", "Aisha", "Siya", "Zoya"))),
        preset=f"weights:{folder.name}",
        random_weights=False,
    )


def _read_layout(folder: Path) -> dict[str, Any]:
    """Our layout file, else the keys upstream's config.json carries."""
    if (folder / LAYOUT_FILE).exists():
        return json.loads((folder / LAYOUT_FILE).read_text())
    cfg = json.loads((folder / "config.json").read_text())
    missing = [k for k in ("first_unit_id", "audio_end_token_id") if k not in cfg]
    if missing:
        raise WeightsError(f"{folder}: config.json lacks the audio layout keys {missing}")
    return {
        "first_unit_id": cfg["first_unit_id"],
        "codebook_size": cfg.get("codebook_size", 2048),
        "num_quantizers": cfg.get("num_quantizers", 8),
        "audio_end_token_id": cfg["audio_end_token_id"],
        "tokenizer": "auto",
        "voices": cfg.get("speakers", ["Ira", "Aisha", "Siya", "Zoya"]),
    }


def _load_codec(folder: Path) -> MimiModel:
    from transformers import MimiModel

    if (folder / "mimi" / "config.json").exists():
        return MimiModel.from_pretrained(folder / "mimi", local_files_only=True)
    try:  # upstream ships Mimi separately: kyutai/mimi, from the HF cache only
        return MimiModel.from_pretrained("kyutai/mimi", local_files_only=True)
    except Exception as exc:
        raise WeightsError(
            f"{folder}: no mimi/ subfolder and kyutai/mimi is not in the HF cache: {exc}"
        ) from exc
