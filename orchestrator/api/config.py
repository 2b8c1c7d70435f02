"""Typed configuration: model, workload, stack and protocol, loaded from YAML.

Every model forbids unknown keys, so a typo in a YAML file is an error at load time rather
than a silently ignored setting. These objects are the start of the one-way data flow:
config -> plan -> worker -> result record -> store -> report.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_PACKAGE = Path(__file__).resolve().parents[1]
REPO_ROOT = _PACKAGE.parent  # the checkout (its git state names a measurement's code)
# The shipped configs/ and experiments/: package data beside the package in an installed
# wheel, the checkout's own folders otherwise. A user's ./experiments and ./configs (the
# working directory's) are searched before them (`_resolve`).
SHIPPED_ROOT = _PACKAGE if (_PACKAGE / "experiments").is_dir() else REPO_ROOT
CONFIG_DIR = SHIPPED_ROOT / "configs"
EXPERIMENTS_DIR = SHIPPED_ROOT / "experiments"


class ConfigError(ValueError):
    """A configuration file or value is malformed; the message says where and why."""


# Names that become file or folder names (prompt ids -> WAVs, stack names -> folders, workload
# names -> holdout files, job ids -> job folders): letters, digits and _ . @ + -, starting
# with a letter or digit, so no name can hold a separator, start with a dot or be "..".
SAFE_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@+\-]{0,99}$"
_SAFE = re.compile(SAFE_NAME)
# Bounds on every size a file can set: each is far above any real use, and stops a typo or
# a hostile file from asking for hours of synthesis or gigabytes of WAVs.
MAX_PROMPTS, MAX_TEXT_CHARS, MAX_SEEDS = 1000, 2000, 100
MAX_SEED = 2**32 - 1  # numpy's and the families' generators take seeds in [0, 2**32)
MAX_TOKENS, MAX_FRAMES, MAX_WARMUPS, MAX_SAVE_AUDIO = 65536, 8192, 100, 1000


def safe_name(kind: str, value: str) -> str:
    """`value` if it is a safe name (SAFE_NAME), else ValueError naming it."""
    if not _SAFE.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} is not a safe name: use 1 to 100 letters, digits and _ . @ + -, "
            "starting with a letter or digit (it becomes a file name)"
        )
    return value


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
    max_new_tokens: int = Field(
        2048, ge=8, le=MAX_TOKENS, description="Token cap (8 tokens = one 80 ms frame)."
    )
    min_tokens_before_stop: int = Field(
        8,
        ge=0,
        le=MAX_TOKENS,
        description="End-of-audio is masked and the stop head not consulted before this.",
    )


class LengthPolicy(Strict):
    """How long each clip is.

    'model' honours the stop head and the end token (only meaningful with real weights).
    'fixed' and 'per_char' fix the number of frames per prompt: the end token is masked out
    and the stop head is still evaluated (its cost is paid) but not obeyed, so every stack
    in a comparison generates the same number of tokens.
    """

    mode: Literal["model", "fixed", "per_char"] = "fixed"
    frames: int = Field(80, ge=1, le=MAX_FRAMES, description="Frames per clip for mode 'fixed'.")
    frames_per_char: float = Field(
        1.0, gt=0, le=100, description="Frames per text character, 'per_char'."
    )
    min_frames: int = Field(1, ge=1, le=MAX_FRAMES)
    max_frames: int = Field(256, ge=1, le=MAX_FRAMES)

    def frames_for(self, text: str) -> int | None:
        """Frames to generate for `text`, or None when the model decides."""
        if self.mode == "model":
            return None
        if self.mode == "fixed":
            return self.frames
        n = round(len(text) * self.frames_per_char)
        return max(self.min_frames, min(self.max_frames, n))


class Prompt(Strict):
    id: str = Field(description="Names the prompt's WAVs: a safe name (SAFE_NAME).")
    text: str = Field(description="What is synthesised; empty or whitespace-only is an error.")
    point: str | None = Field(None, description="Operating point (Workload.operating_points).")

    @model_validator(mode="after")
    def _has_text(self) -> Prompt:
        # Checked here, not with min_length, so the error can name the prompt: a blank text
        # would otherwise be synthesised (and timed) as silence.
        safe_name("prompt id", self.id)
        if not self.text.strip():
            raise ValueError(f"prompt {self.id!r} has no text (empty or only whitespace)")
        if len(self.text) > MAX_TEXT_CHARS:
            raise ValueError(
                f"prompt {self.id!r} has {len(self.text)} characters; at most {MAX_TEXT_CHARS}"
            )
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


MAX_STREAMS, MAX_SERVE_S = 65536, 3600.0


class ServingLoad(Strict):
    """Many streams at once: N arriving together (`concurrency`), Poisson arrivals at
    `rate` per second for `duration_s`, or a sustained load (`sustained`: Poisson arrivals for
    `duration_s` at the rate that keeps that many streams playing, its figures also kept
    apart for the streams arriving once that many could be live). A workload with a load is
    a serving workload: its stacks need a technique that serves many streams (Rumik:
    `batched_decode`), and its figures are per stream (time to first audio, underruns,
    served) instead of per utterance. Streams take the workload's prompts and seeds in turn."""

    concurrency: int | None = Field(None, ge=1, le=MAX_STREAMS)
    rate: float | None = Field(None, gt=0, description="Poisson arrivals per second.")
    sustained: int | None = Field(
        None, ge=1, le=MAX_STREAMS, description="Streams kept playing by Poisson arrivals."
    )
    duration_s: float | None = Field(None, gt=0, le=MAX_SERVE_S, description="Arrivals stop after.")
    frames: int = Field(80, ge=1, le=MAX_FRAMES, description="Audio frames (80 ms) per stream.")
    chunk_frames: int = Field(1, ge=1, le=MAX_FRAMES, description="Frames per audio chunk sent.")
    time_limit_s: float = Field(
        300.0,
        gt=0,
        le=MAX_SERVE_S,
        description="A stack's level stops here; late streams: incomplete.",
    )
    arrival_seed: int = Field(0, ge=0, le=MAX_SEED, description="Seeds the Poisson arrivals.")

    @model_validator(mode="after")
    def _one_shape(self) -> ServingLoad:
        shapes = [n for n in ("concurrency", "rate", "sustained") if getattr(self, n) is not None]
        if len(shapes) > 1:
            given = " and ".join(shapes)
            raise ValueError(f"give one of concurrency, rate and sustained, not {given}")
        if self.sustained is not None:
            if self.duration_s is None:
                raise ValueError(f"sustained: {self.sustained} needs a duration_s")
            return self  # its length against a stream's: orchestrate.running.serving.sustained
        if self.rate is not None and self.duration_s is None:
            raise ValueError(f"arrival rate {self.rate:g}/s given without a duration_s")
        if self.rate is None and self.duration_s is not None:
            raise ValueError(f"a duration_s ({self.duration_s:g} s) needs an arrival rate")
        if self.rate is None and self.concurrency is None:
            raise ValueError("a load needs a concurrency, an arrival rate or sustained")
        return self

    def label(self) -> str:
        if self.sustained is not None:
            return f"sustained {self.sustained} streams for {self.duration_s:g} s"
        if self.rate is not None:
            return f"Poisson {self.rate:g}/s for {self.duration_s:g} s"
        return f"{self.concurrency} concurrent streams"


class Workload(Strict):
    name: str = Field(description="Names its files (holdout, reports): a safe name.")
    prompts: list[Prompt] = Field(min_length=1, max_length=MAX_PROMPTS)
    seeds: list[int] = Field(default_factory=lambda: [42], min_length=1, max_length=MAX_SEEDS)
    voice: str = "Ira"
    delivery: str | None = Field(None, description="Inline <description=...> text, e.g. 'neutral'.")
    sampling: SamplingConfig = SamplingConfig()
    warmups: int = Field(3, ge=0, le=MAX_WARMUPS)
    length_policy: LengthPolicy = LengthPolicy()
    save_audio: int = Field(
        2, ge=0, le=MAX_SAVE_AUDIO, description="WAVs kept per stack (for listening, MLflow)."
    )
    operating_points: dict[str, OperatingPoint] = Field(
        default_factory=dict,
        description="Named request classes with weights; S = sum(weight x median RTF).",
    )
    load: ServingLoad | None = Field(
        None, description="Many streams at once (a serving workload); none: one at a time."
    )
    measure_ttfa: bool = Field(
        True,
        description="Also time each prompt to its first decoded 80 ms frame (a one-frame "
        "synthesis through the same path: prefill + 8 tokens + codec), as a streaming "
        "server would see it. Not part of the latency/RTF numbers.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        return safe_name("workload name", name)

    def single_stream(self, command: str) -> Workload:
        """This workload, if it is one stream at a time; ConfigError naming `command`
        otherwise (noise, gates and explorations compare per-utterance speed)."""
        if self.load is not None:
            raise ConfigError(
                f"`{command}` compares per-utterance speed; workload {self.name!r} is a "
                f"serving workload ({self.load.label()}): measure it with `orchestrate run`"
            )
        return self

    @field_validator("prompts")
    @classmethod
    def _unique_ids(cls, prompts: list[Prompt]) -> list[Prompt]:
        ids = [p.id for p in prompts]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate prompt ids: {dupes}")
        return prompts

    @field_validator("seeds")
    @classmethod
    def _seeds_in_range(cls, seeds: list[int]) -> list[int]:
        # Here, not in the worker: a bad seed is a bad file (exit 2, nothing stored), not a
        # FAILED run. A repeated seed would time the same utterance twice as two samples.
        bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
        if bad:
            raise ValueError(f"seed {bad[0]} is out of range: seeds are 0 to {MAX_SEED}")
        dupes = sorted({s for s in seeds if seeds.count(s) > 1})
        if dupes:
            raise ValueError(f"duplicate seeds: {dupes}")
        return seeds

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

    name: str = Field(description="Names its folders of WAVs: a safe name (SAFE_NAME).")
    family: str = "rumik"
    description: str = ""
    techniques: list[TechniqueRef] = Field(default_factory=list)
    baseline: bool = Field(
        False,
        description="A second baseline (what a user would pick instead of stock): every "
        "other stack in a run with it also reports its speedup against this one.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        return safe_name("stack name", name)

    @model_validator(mode="after")
    def _no_repeats(self) -> StackSpec:
        names = [t.name for t in self.techniques]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"technique listed more than once: {dupes}")
        return self


# ------------------------------------------------------------------------- loading


MAX_FILE_BYTES = 1 << 20  # no config is near 1 MiB; a larger file is not one


def read_yaml(path: Path) -> dict[str, Any]:
    """A config file's top-level mapping, or ConfigError saying in one line why it is not one
    (too large, not UTF-8, unreadable, not YAML, not a mapping)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not a config file")
        data = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): save it as UTF-8") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_model(cls: type[Strict], path: Path) -> Any:
    try:
        return cls.model_validate(read_yaml(path))
    except ValidationError as exc:
        raise ConfigError(f"{path}: {explain(exc)}") from exc


def explain(exc: ValidationError) -> str:
    """A ValidationError as one line (`where: why; ...`), without pydantic's URLs; a
    message quoting a file's value (a multi-line text) keeps only its first line."""
    parts = []
    for err in exc.errors()[:5]:  # a file wrong everywhere: the first few say enough
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {one_line(msg)}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


_PYDANTIC_TAIL = re.compile(
    r"\s*\[type=[^\]]*\]\s*(For further information visit https://errors\.pydantic\.dev/\S+)?"
)


def without_pydantic_detail(text: str) -> str:
    """`text` with pydantic's `[type=..., input_value=...]` and documentation link cut out:
    reasons stored before they were worded by `explain` read as sentences too."""
    return _PYDANTIC_TAIL.sub("", text)


def one_line(text: str, limit: int = 200) -> str:
    """`text`'s first line, at most `limit` characters: errors never echo a whole file."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What PyYAML found and where, without the file's lines it quotes."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return one_line(f"{problem}{where}")


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
    folders = search_path(folder)
    for where in folders:
        candidate = where / f"{name_or_path}.yaml"
        if candidate.exists():
            return candidate
    known = sorted({p.stem for where in folders for p in where.glob("*.yaml")})
    raise ConfigError(f"unknown {kind} {name_or_path!r}; known: {', '.join(known) or 'none'}")


def search_path(shipped: Path) -> list[Path]:
    """Where a name is looked up: the working directory's folder of the same place
    (./experiments, ./configs/workloads, ...) first, then the shipped one."""
    user = Path.cwd() / shipped.relative_to(SHIPPED_ROOT)
    same = user.resolve() == shipped.resolve()
    return [shipped] if same or not user.is_dir() else [user, shipped]


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
    models_dirs = search_path(CONFIG_DIR / "models")
    presets = [d / f"{preset_or_path}.yaml" for d in models_dirs]
    preset_file = next((p for p in presets if p.exists()), presets[-1])
    if Path(preset_or_path).suffix in {".yaml", ".yml"} and Path(preset_or_path).is_file():
        preset_file = Path(preset_or_path)
    if looks_like_path(preset_or_path) and not Path(preset_or_path).exists():
        raise ConfigError(f"no such file: {preset_or_path}")
    if preset_file.exists():
        spec = load_model(ModelSpec, preset_file)
    elif Path(preset_or_path).is_dir():
        if not any(Path(preset_or_path).iterdir()):  # at planning: exit 2, no FAILED row
            raise ConfigError(f"weights folder {Path(preset_or_path).resolve()} is empty")
        spec = ModelSpec(preset="from-weights", weights=str(Path(preset_or_path).resolve()))
    else:
        known = sorted({p.stem for d in models_dirs for p in d.glob("*.yaml")})
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
