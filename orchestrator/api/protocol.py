"""The research protocol beyond speed: scorer set, quality metrics, gates, the speed rule, and
how noise turns into gates; plus version checks so results under different protocols are
never compared silently.

The models here are fields of `Protocol` (a frozen YAML file whose content hash is
stored with every run, score and decision). This module imports only pydantic and the
standard library at the top: the worker loads protocols too, and needs no database.

Rules enforced at load:
- a gate may only name a metric the protocol defines (a typo is an error, not a no-op);
- every metric computed by a scorer has that scorer kind in the scorer set;
- 'pooled' aggregation exists only for ASR error rates (total errors / total words).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from orchestrate.api.config import CONFIG_DIR, ConfigError, Strict, load_model

ScorerKind = Literal["asr", "mos", "sim", "integrity"]
Source = Literal["asr", "mos", "sim", "integrity", "fidelity"]
PHASE_SEPARATOR = "@"  # "smoke@holdout": the holdout phase of workload "smoke"


class ProtocolError(ValueError):
    """A protocol is malformed, changed without a version bump, or mixed with another."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MetricDef(_Frozen):
    """A quality metric: where its per-utterance value comes from and how it aggregates."""

    source: Source = Field(description="Scorer kind, or 'fidelity' (teacher-forced vs stock).")
    value: str = Field(description="Key in the scorer's values (or a FidelityRecord field).")
    aggregate: Literal["mean", "pooled"] = Field(
        "mean", description="'pooled': total errors / total reference length (ASR only)."
    )
    better: Literal["lower", "higher"]

    @model_validator(mode="after")
    def _pooled_is_asr(self) -> MetricDef:
        if self.aggregate == "pooled" and not (self.source == "asr" and self.value in POOLED):
            raise ValueError(f"'pooled' aggregation is defined for asr {sorted(POOLED)} only")
        return self


# error-count keys the ASR scorer stores per utterance, so pooled rates can be recomputed
POOLED = {"wer": ("word_errors", "ref_words"), "cer": ("char_errors", "ref_chars")}

DEFAULT_METRICS: dict[str, MetricDef] = {
    "wer": MetricDef(source="asr", value="wer", better="lower"),
    "pooled_wer": MetricDef(source="asr", value="wer", aggregate="pooled", better="lower"),
    "cer": MetricDef(source="asr", value="cer", better="lower"),
    "mos": MetricDef(source="mos", value="mos", better="higher"),
    "sim": MetricDef(source="sim", value="sim", better="higher"),
    "clipped_fraction": MetricDef(source="integrity", value="clipped_fraction", better="lower"),
    "fidelity_mean_kl": MetricDef(source="fidelity", value="mean_kl", better="lower"),
    "fidelity_topk": MetricDef(source="fidelity", value="topk_agreement", better="higher"),
}

DEFAULT_SCORERS: dict[ScorerKind, str] = {
    "asr": "whisper_tiny_en",
    "mos": "dnsmos",
    "sim": "resemblyzer",
    "integrity": "integrity",
}


class Gate(_Frozen):
    """A bound on a candidate's metric: on its delta against stock, or on its value."""

    metric: str
    max_delta: float | None = Field(None, description="candidate - stock must be <= this")
    min_delta: float | None = Field(None, description="candidate - stock must be >= this")
    max_value: float | None = None
    min_value: float | None = None
    origin: Literal["manual", "noise"] = "manual"
    note: str = Field("", description="Where the bound came from (noise runs, spread, rule).")

    @model_validator(mode="after")
    def _has_a_bound(self) -> Gate:
        if all(b is None for b in (self.max_delta, self.min_delta, self.max_value, self.min_value)):
            raise ValueError(f"gate on {self.metric!r} sets no bound")
        return self

    def describe(self) -> str:
        parts = []
        if self.max_delta is not None:
            parts.append(f"Δ ≤ {self.max_delta:+.4g}")
        if self.min_delta is not None:
            parts.append(f"Δ ≥ {self.min_delta:+.4g}")
        if self.max_value is not None:
            parts.append(f"≤ {self.max_value:.4g}")
        if self.min_value is not None:
            parts.append(f"≥ {self.min_value:.4g}")
        return f"{self.metric} " + ", ".join(parts)


class QualitySpec(_Frozen):
    """Which scorers compute which metrics, and the gates a candidate must hold."""

    scorers: dict[ScorerKind, str] = Field(
        default_factory=lambda: dict(DEFAULT_SCORERS),
        description="Scorer plugin per kind. Fixed, never a fallback: scores must be comparable.",
    )
    metrics: dict[str, MetricDef] = Field(default_factory=lambda: dict(DEFAULT_METRICS))
    gates: list[Gate] = Field(default_factory=list)
    max_new_coverage_failures: int = Field(
        0, ge=0, description="Unscoreable or missing recordings the candidate may add over stock."
    )
    noise_gated: list[str] = Field(
        default_factory=lambda: ["wer", "cer", "mos", "sim"],
        description="Metrics `orchestrate noise` writes gates for, from their measured spread.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> QualitySpec:
        for gate in self.gates:
            if gate.metric not in self.metrics:
                raise ValueError(
                    f"gate refers to metric {gate.metric!r}, which the protocol does not "
                    f"define; defined metrics: {', '.join(sorted(self.metrics))}"
                )
        unknown = sorted(set(self.noise_gated) - set(self.metrics))
        if unknown:
            raise ValueError(f"noise_gated names undefined metrics {unknown}")
        for name, m in self.metrics.items():
            if m.source != "fidelity" and m.source not in self.scorers:
                raise ValueError(f"metric {name!r} needs a {m.source!r} scorer in `scorers`")
        return self


class SpeedRule(_Frozen):
    """When a candidate counts as faster: the lower bound of a bootstrap confidence interval
    on the paired per-utterance speedup must exceed `min_speedup` (1 + measured noise)."""

    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    resamples: int = Field(2000, ge=200)
    seed: int = Field(0, description="Bootstrap RNG seed: the same data gives the same CI.")
    min_speedup: float = Field(1.0, ge=1.0)
    weights: dict[str, float] = Field(
        default_factory=lambda: {"*": 1.0},
        description="Prompt-id glob -> weight of its utterances (first match wins).",
    )
    origin: Literal["default", "manual", "noise"] = "default"
    note: str = ""

    @model_validator(mode="after")
    def _weights_positive(self) -> SpeedRule:
        bad = {k: v for k, v in self.weights.items() if not v > 0}
        if bad or not self.weights:
            raise ValueError(f"speed weights must be a non-empty map of positive values: {bad}")
        return self


AA_CV_DEFAULT = 0.15


class NoiseRule(_Frozen):
    """How `orchestrate noise` turns repeated stock measurements into gates.

    A gate's tolerance is the largest of: `k` x sqrt(2) x the sd of the per-repeat means
    (the spread of a difference between two runs), the largest difference seen between two
    repeats, and the metric's floor (so a deterministic metric with zero spread still gets
    a stated, non-zero tolerance instead of an impossible one).

    No gates at all when the machine is too noisy: if the speed metric over every A/A
    measurement has sd/mean above `max_aa_cv`, `noise` writes no protocol.
    """

    k: float = Field(2.0, gt=0)
    seed_stride: int = Field(
        1000, ge=1, description="Repeat r samples with seed + r x stride: sampling noise counts."
    )
    floors: dict[str, float] = Field(
        default_factory=lambda: {
            "wer": 0.01,
            "pooled_wer": 0.01,
            "cer": 0.01,
            "mos": 0.05,
            "sim": 0.01,
            "clipped_fraction": 0.001,
        }
    )
    max_aa_cv: float = Field(
        AA_CV_DEFAULT,
        gt=0,
        description="Largest A/A timing spread (sd/mean of the speed metric over the stack and "
        "its A/A copy, every repeat) `orchestrate noise` accepts; above it the machine is too "
        "noisy to set gates and no protocol version is written.",
    )

    @model_serializer(mode="wrap")
    def _hash_stable(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # max_aa_cv came after protocols were recorded: left out of the dump at its default,
        # every protocol hashed before it existed keeps its hash (runs, recorded versions).
        data = handler(self)
        if self.max_aa_cv == AA_CV_DEFAULT:
            data.pop("max_aa_cv", None)
        return data


class Provenance(_Frozen):
    """Where a protocol version came from (set by `orchestrate noise`)."""

    parent_hash: str
    parent_version: int
    noise_runs: list[str] = Field(default_factory=list)
    created_by: str = "orchestrate noise"


# ---------------------------------------------------------------------------- protocol


class Protocol(Strict):
    """Frozen metric definitions. Its hash is stored with every run."""

    name: str = "default"
    version: int = 1
    speed_metric: Literal["rtf", "median_latency_s"] = "rtf"
    speed_aggregation: Literal["total_time_over_total_audio"] = "total_time_over_total_audio"
    timer_scope: str = "prompt construction -> completed CPU waveform (codec decode included)"
    # Scorers, quality metrics, gates, the speed rule and how noise becomes gates: see
    # this module. Defaults keep older protocol files loading.
    quality: QualitySpec = Field(default_factory=QualitySpec)
    speed: SpeedRule = Field(default_factory=SpeedRule)
    noise: NoiseRule = Field(default_factory=NoiseRule)
    provenance: Provenance | None = None


def protocol_path(name_or_path: str = "protocol") -> Path:
    """The file a `--protocol` value names: an existing path, else configs/NAME.yaml."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = CONFIG_DIR / f"{name_or_path}.yaml"
    if named.is_file():
        return named
    raise ConfigError(f"no protocol {name_or_path!r}: no such file, nor {named}")


def load_protocol(name_or_path: str = "protocol") -> Protocol:
    return load_model(Protocol, protocol_path(name_or_path))


def version_path(protocol: Protocol, beside: Path) -> Path:
    """Where a new version goes by default: protocols/NAME-vN.yaml in the folder of the file
    it derives from (configs/protocols/ for configs/protocol.yaml), never over that file."""
    return beside.parent / "protocols" / f"{protocol.name}-v{protocol.version}.yaml"


# ----------------------------------------------------------------------------- helpers


def protocol_hash(protocol: Protocol) -> str:
    return protocol.content_hash()


def label(protocol: Protocol) -> str:
    return f"{protocol.name} v{protocol.version} ({protocol.content_hash()})"


def phase_workload(workload_name: str, phase: str) -> str:
    return f"{workload_name}{PHASE_SEPARATOR}{phase}"


def split_phase(workload_name: str) -> tuple[str, str]:
    """('smoke', 'holdout') for 'smoke@holdout'; ('smoke', 'dev') for 'smoke'."""
    base, _, phase = workload_name.partition(PHASE_SEPARATOR)
    return base, phase or "dev"


def require_gates(protocol: Protocol) -> None:
    """Noise first: a phase gate without measured quality gates would accept anything."""
    if not protocol.quality.gates:
        raise ProtocolError(
            f"protocol {label(protocol)} defines no quality gates; measure run-to-run noise "
            "first (`orchestrate noise --stack stock --repeats N`) and use the protocol "
            "version it writes"
        )


def require_same(hashes: dict[str, str]) -> str:
    """The one protocol hash shared by all `hashes` (what -> hash), else ProtocolError."""
    distinct = sorted(set(hashes.values()))
    if len(distinct) != 1:
        detail = ", ".join(f"{what}: {h}" for what, h in sorted(hashes.items()))
        raise ProtocolError(
            f"refusing to compare results measured under different protocols ({detail})"
        )
    return distinct[0]


def bumped(
    protocol: Protocol,
    noise_runs: list[str] | None = None,
    version: int | None = None,
    **changes: Any,
) -> Protocol:
    """The next version of `protocol` with `changes`, recording its parent. `version` skips
    numbers already taken (a second `noise` from the same parent); it must be newer."""
    version = protocol.version + 1 if version is None else version
    if version <= protocol.version:
        raise ProtocolError(f"a new version must be > {protocol.version}, got {version}")
    data = protocol.model_dump(mode="json")
    data.update(changes)
    data["version"] = version
    data["provenance"] = Provenance(
        parent_hash=protocol.content_hash(),
        parent_version=protocol.version,
        noise_runs=list(noise_runs or []),
    ).model_dump()
    return Protocol.model_validate(data)


def write(protocol: Protocol, path: Path) -> None:
    """Write a protocol version to `path` (YAML, every field explicit: frozen means frozen).

    Overwriting is allowed only with a newer version of the same protocol, so a file never
    changes meaning under an unchanged version number.
    """
    if path.exists():
        try:
            old = load_protocol(str(path))
        except ConfigError:
            old = None
        if (
            old is not None
            and old.content_hash() != protocol.content_hash()
            and old.name == protocol.name
            and old.version >= protocol.version
        ):
            raise ProtocolError(
                f"{path} holds {label(old)}; writing a different protocol there needs "
                f"version > {old.version} (got {protocol.version})"
            )
    header = (
        f"# Protocol {protocol.name} v{protocol.version}: frozen metric definitions and gates.\n"
        "# Do not edit in place: a change is a new version (`orchestrate noise` writes one).\n"
        f"# content hash: {protocol.content_hash()}\n"
    )
    # None fields are left out for readability; they load back as the same defaults, so the
    # content hash (of the loaded model, not of the text) is unchanged.
    data = protocol.model_dump(mode="json", exclude_none=True)
    data["noise"]["max_aa_cv"] = protocol.noise.max_aa_cv  # shown even at its default
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(header + body)
    if load_protocol(str(tmp)).content_hash() != protocol.content_hash():
        tmp.unlink()
        raise ProtocolError(f"{path}: the written protocol does not load back identically")
    tmp.replace(path)
