"""Typed configuration: model, workload, stack and protocol, loaded from YAML.

Every model forbids unknown keys, so a typo in a YAML file is an error at load time rather
than a silently ignored setting. These objects are the start of the one-way data flow:
config -> plan -> worker -> result record -> store -> report.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
EXPERIMENTS_DIR = REPO_ROOT / "experiments"


class ConfigError(ValueError):
    """A configuration file or value is malformed; the message says where and why."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def content_hash(self) -> str:
        """Stable short hash of the canonical JSON form (identity of a config)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- model


class ModelSpec(Strict):
    """Which model to build: a family, a size preset, and optionally real weights."""

    family: str = "rumik"
    preset: str = Field("tiny", description="Architecture preset, e.g. 'tiny' or 'rumik-oss-1'.")
    weights: str | None = Field(
        None,
        description="Local folder (save_pretrained layout) or HF repo id already in the HF "
        "cache. None builds the preset's real architecture with random weights.",
    )
    revision: str | None = Field(None, description="Revision pin for an HF-cache checkpoint.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    init_seed: int = Field(0, description="Seed for random weights (identical across stacks).")


# ------------------------------------------------------------------------ workload


class SamplingConfig(Strict):
    temperature: float = Field(0.8, gt=0)
    top_k: int = Field(30, ge=1)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(2048, ge=8, description="Token cap (8 tokens = one 80 ms frame).")
    min_tokens_before_stop: int = Field(
        8, ge=0, description="End-of-audio is masked and the stop head not consulted before this."
    )


class LengthPolicy(Strict):
    """How long each clip is.

    'model' honours the stop head and the end token (only meaningful with real weights).
    'fixed' and 'per_char' fix the number of frames per prompt: the end token is masked out
    and the stop head is still evaluated (its cost is paid) but not obeyed, so every stack
    in a comparison generates the same number of tokens.
    """

    mode: Literal["model", "fixed", "per_char"] = "fixed"
    frames: int = Field(80, ge=1, description="Frames per clip for mode 'fixed'.")
    frames_per_char: float = Field(1.0, gt=0, description="Frames per text character, 'per_char'.")
    min_frames: int = Field(1, ge=1)
    max_frames: int = Field(256, ge=1)

    def frames_for(self, text: str) -> int | None:
        """Frames to generate for `text`, or None when the model decides."""
        if self.mode == "model":
            return None
        if self.mode == "fixed":
            return self.frames
        n = round(len(text) * self.frames_per_char)
        return max(self.min_frames, min(self.max_frames, n))


class Prompt(Strict):
    id: str
    text: str = Field(description="What is synthesised; empty or whitespace-only is an error.")
    point: str | None = Field(None, description="Operating point (Workload.operating_points).")

    @model_validator(mode="after")
    def _has_text(self) -> Prompt:
        # Checked here, not with min_length, so the error can name the prompt: a blank text
        # would otherwise be synthesised (and timed) as silence.
        if not self.text.strip():
            raise ValueError(f"prompt {self.id!r} has no text (empty or only whitespace)")
        return self


class OperatingPoint(Strict):
    """A request class with a weight in the primary metric S = sum(weight x median RTF).

    mode/instruct/ref_audio/ref_text/language are OmniVoice's request modes; the Rumik
    family does not read them (its voice and delivery are workload-wide).
    """

    weight: float = Field(1.0, gt=0)
    mode: Literal["auto", "design", "clone"] = "auto"
    instruct: str | None = Field(None, description="Design mode: e.g. 'female, british accent'.")
    ref_audio: str | None = Field(None, description="Clone mode: WAV path (relative: repo root).")
    ref_text: str | None = Field(None, description="Clone mode: transcript of ref_audio.")
    language: str | None = None

    @model_validator(mode="after")
    def _mode_inputs(self) -> OperatingPoint:
        if self.mode == "design" and not self.instruct:
            raise ValueError("mode 'design' needs an instruct")
        if self.mode == "clone" and not (self.ref_audio and self.ref_text):
            raise ValueError(
                "mode 'clone' needs ref_audio and ref_text (without a transcript OmniVoice "
                "would download Whisper to make one)"
            )
        return self


class Workload(Strict):
    name: str
    prompts: list[Prompt] = Field(min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [42], min_length=1)
    voice: str = "Ira"
    delivery: str | None = Field(None, description="Inline <description=...> text, e.g. 'neutral'.")
    sampling: SamplingConfig = SamplingConfig()
    warmups: int = Field(3, ge=0)
    length_policy: LengthPolicy = LengthPolicy()
    save_audio: int = Field(2, ge=0, description="WAVs kept per stack (for listening, MLflow).")
    operating_points: dict[str, OperatingPoint] = Field(
        default_factory=dict,
        description="Named request classes with weights; S = sum(weight x median RTF).",
    )
    measure_ttfa: bool = Field(
        True,
        description="Also time each prompt to its first decoded 80 ms frame (a one-frame "
        "synthesis through the same path: prefill + 8 tokens + codec), as a streaming "
        "server would see it. Not part of the latency/RTF numbers.",
    )

    @field_validator("prompts")
    @classmethod
    def _unique_ids(cls, prompts: list[Prompt]) -> list[Prompt]:
        ids = [p.id for p in prompts]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate prompt ids: {dupes}")
        return prompts

    @model_validator(mode="after")
    def _points_declared(self) -> Workload:
        if not self.operating_points:
            if any(p.point for p in self.prompts):
                raise ValueError("prompts name operating points but none are declared")
            return self
        unknown = sorted({p.point or "<none>" for p in self.prompts} - set(self.operating_points))
        if unknown:
            raise ValueError(
                f"prompts with undeclared operating points {unknown}; declared: "
                f"{sorted(self.operating_points)} (every prompt needs one)"
            )
        return self


# --------------------------------------------------------------------------- stack


class TechniqueRef(Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class StackSpec(Strict):
    """An ordered list of techniques applied to a family's stock engine. [] is stock."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    family: str = "rumik"
    description: str = ""
    techniques: list[TechniqueRef] = Field(default_factory=list)
    baseline: bool = Field(
        False,
        description="A second baseline (what a user would pick instead of stock): every "
        "other stack in a run with it also reports its speedup against this one.",
    )

    @model_validator(mode="after")
    def _no_repeats(self) -> StackSpec:
        names = [t.name for t in self.techniques]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"technique listed more than once: {dupes}")
        return self


# ------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_model(cls: type[Strict], path: Path) -> Any:
    try:
        return cls.model_validate(_read_yaml(path))
    except ValidationError as exc:
        raise ConfigError(f"{path}: {explain(exc)}") from exc


def explain(exc: ValidationError) -> str:
    """A ValidationError as one line (`where: why; ...`), without pydantic's URLs."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {str(err['msg']).removeprefix('Value error, ')}")
    return "; ".join(parts)


def looks_like_path(name_or_path: str) -> bool:
    """A name with a slash or a YAML suffix is a path: when it is missing, 'unknown stack'
    (and a list of names) would send the user looking in the wrong place."""
    return "/" in name_or_path or Path(name_or_path).suffix in {".yaml", ".yml"}


def _resolve(name_or_path: str, folder: Path, kind: str) -> Path:
    path = Path(name_or_path)
    if looks_like_path(name_or_path):
        if not path.exists():
            raise ConfigError(f"no such file: {name_or_path}")
        if not path.is_file():
            raise ConfigError(f"{name_or_path}: not a file (a {kind} is one YAML file)")
        return path
    candidate = folder / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    raise ConfigError(f"unknown {kind} {name_or_path!r}; known: {', '.join(known) or 'none'}")


def stack_path(name_or_path: str) -> Path:
    """The file a stack name (experiments/NAME.yaml) or path refers to."""
    return _resolve(name_or_path, EXPERIMENTS_DIR, "stack")


def load_stack(name_or_path: str) -> StackSpec:
    return load_model(StackSpec, stack_path(name_or_path))


def load_workload(name_or_path: str) -> Workload:
    return load_model(Workload, _resolve(name_or_path, CONFIG_DIR / "workloads", "workload"))


def load_model_spec(
    preset_or_path: str, device: str | None = None, dtype: str | None = None
) -> ModelSpec:
    """A preset name (configs/models/NAME.yaml), a model YAML file (a third-party family's
    presets live with it), or a local weights folder."""
    models_dir = CONFIG_DIR / "models"
    preset_file = models_dir / f"{preset_or_path}.yaml"
    if Path(preset_or_path).suffix in {".yaml", ".yml"} and Path(preset_or_path).is_file():
        preset_file = Path(preset_or_path)
    if looks_like_path(preset_or_path) and not Path(preset_or_path).exists():
        raise ConfigError(f"no such file: {preset_or_path}")
    if preset_file.exists():
        spec = load_model(ModelSpec, preset_file)
    elif Path(preset_or_path).is_dir():
        spec = ModelSpec(preset="from-weights", weights=str(Path(preset_or_path).resolve()))
    else:
        known = sorted(p.stem for p in models_dir.glob("*.yaml"))
        raise ConfigError(
            f"unknown model {preset_or_path!r}: not a preset ({', '.join(known)}) "
            "and not an existing local weights folder"
        )
    updates: dict[str, Any] = {}
    if device:
        updates["device"] = device
    if dtype:
        updates["dtype"] = dtype
    try:
        return ModelSpec.model_validate({**spec.model_dump(), **updates})
    except ValidationError as exc:
        raise ConfigError(f"model {preset_or_path!r}: {explain(exc)}") from exc


SCHEMAS: dict[str, type[Strict]] = {
    "model": ModelSpec,
    "workload": Workload,
    "stack": StackSpec,
}
