"""Score a run's saved recordings with the protocol's scorer set, apart from synthesis.

Scoring reads WAVs and a result record, never a model, so it can run on another worker:
`orchestrate score --result RESULT.json --out SCORES.json` there, `orchestrate score
--ingest SCORES.json` here. Every utterance the job asked for gets a row per scorer: a score
(with scorer name, version, weights hash, packages and any resampling) or a coverage
failure saying why it could not be scored (not saved, file missing, unreadable, empty,
NaN, no speech). Nothing is skipped.

Speaker similarity needs a reference speaker: each utterance is compared with the stock
(baseline) stack's recording of a *different* utterance of the same run, so stock itself
gets a real, non-trivial SIM too and candidate - stock deltas are like for like.
"""

from __future__ import annotations

import hashlib
import math
import socket
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from orchestrate.api.protocol import POOLED, Protocol
from orchestrate.api.records import Record, ResultRecord, UtteranceRecord, utcnow
from orchestrate.api.sealed import resolve

if TYPE_CHECKING:
    import numpy as np

    from orchestrate.api.scoring import Scorer
    from orchestrate.store.store import Store


class ScoreRow(Record):
    stack: str
    utterance: int = Field(description="Index in the stack's utterance list.")
    prompt_id: str
    seed: int
    round: int
    scorer: str
    scorer_version: str
    kind: str
    reference: bool
    weights_id: str
    status: Literal["ok", "coverage_failure"]
    values: dict[str, float] = Field(default_factory=dict)
    details: dict[str, str] = Field(default_factory=dict)
    resample: dict[str, Any] | None = None
    packages: dict[str, str] = Field(default_factory=dict)
    error: str | None = None


class ScoreSheet(Record):
    """Scores of one result record: what a scoring worker hands back."""

    job_id: str
    protocol_hash: str
    scorers: dict[str, str]
    host: str
    created_at: datetime
    rows: list[ScoreRow]


@dataclass
class _Item:
    stack: str
    index: int
    utt: UtteranceRecord
    text: str
    audio: Path | None
    missing: str | None = None
    reference: Path | None = None
    sealed: bool = False  # a holdout prompt: what the scorer heard is stored hashed


def audio_root(result: ResultRecord, result_path: str | Path | None = None) -> Path:
    """Where the run's relative audio paths live: the job's output dir, else next to the
    result file (a result copied from a GPU host together with its WAVs)."""
    out = Path(result.job.output_dir)
    if out.is_dir():
        return out
    if result_path is not None and Path(result_path).parent.is_dir():
        return Path(result_path).parent
    return out


def _items(result: ResultRecord, root: Path) -> list[_Item]:
    # A holdout run's job carries placeholders: the texts come from its sealed file.
    job = result.job
    texts = {p.id: p.text for p in resolve(job.workload, job.sealed_file).prompts}
    items = []
    for sr in result.results:
        for i, u in enumerate(sr.utterances):
            path = None if u.audio_path is None else root / u.audio_path
            missing = None
            if path is None:
                missing = (
                    f"no recording saved (workload save_audio={result.job.workload.save_audio})"
                )
            elif not path.is_file():
                missing = f"recording missing: {path}"
            text, sealed = texts[u.prompt_id], job.sealed_file is not None
            items.append(_Item(sr.stack.name, i, u, text, path, missing, sealed=sealed))
    base = [it for it in items if it.stack == result.job.baseline.name and it.missing is None]
    for it in items:  # speaker reference: stock's recording of another utterance
        others = [b for b in base if b.utt.round != it.utt.round]
        after = [b for b in others if b.utt.round > it.utt.round]
        it.reference = (after or others)[0].audio if others else None
    return items


def expected_utterances(result: ResultRecord) -> int:
    wl = result.job.workload
    return len(wl.prompts) * len(wl.seeds)


def score_result(
    result: ResultRecord,
    protocol: Protocol,
    root: Path,
    scorers: Sequence[Scorer] | None = None,
    skip: set[tuple[str, int, str, str, str]] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> ScoreSheet:
    """Score every utterance of `result` with the protocol's scorers (no database needed).

    `skip` holds (stack, utterance, scorer, version, weights_id) keys already scored;
    `on_event` gets a status event per phase and per stack scored (a minute or more of
    scoring is otherwise silent)."""
    say = on_event or (lambda event: None)
    names = protocol.quality.scorers
    if scorers is None:
        say({"event": "status", "message": f"loading scorers: {', '.join(names.values())}"})
    loaded = list(scorers) if scorers is not None else load_scorers(tuple(names.values()))
    for scorer in loaded:
        scorer.load()  # ScorerUnavailable here is the environment's fault: stop, loudly
    cache: dict[Path, tuple[np.ndarray, int] | str] = {}
    rows = []
    by_stack: dict[str, list[_Item]] = defaultdict(list)
    for it in _items(result, root):
        by_stack[it.stack].append(it)
    for stack, items in by_stack.items():
        before = len(rows)
        for it in items:
            for scorer in loaded:
                key = (it.stack, it.index, scorer.name, scorer.version, scorer.weights_id())
                if not (skip and key in skip):
                    rows.append(_score_one(scorer, it, cache))
        message = f"scored {stack}: {len(items)} utterances, {len(rows) - before} new scores"
        say({"event": "status", "message": message})
    return ScoreSheet(
        job_id=result.job.job_id,
        protocol_hash=protocol.content_hash(),
        scorers=dict(names),
        host=socket.gethostname(),
        created_at=utcnow(),
        rows=rows,
    )


@cache
def load_scorers(names: tuple[str, ...]) -> list[Scorer]:
    """Loaded scorers, once per process: loading Whisper, DNSMOS and the speaker encoder
    costs seconds, and noise scores several runs in one command."""
    from orchestrate.api.scoring import create_scorers

    return [scorer.load() for scorer in create_scorers(list(names))]


def _read(path: Path, cache: dict[Path, Any]) -> tuple[np.ndarray, int] | str:
    """(samples, rate), or why the file cannot be read."""
    import soundfile as sf

    if path not in cache:
        try:
            x, sr = sf.read(str(path), dtype="float32", always_2d=False)
            cache[path] = (x, sr)
        except Exception as exc:  # libsndfile's errors are RuntimeErrors of several kinds
            cache[path] = f"unreadable recording {path}: {exc}"
    return cache[path]


def _score_one(scorer: Scorer, it: _Item, cache: dict[Path, Any]) -> ScoreRow:
    from orchestrate.api.scoring import CoverageFailure

    row = {
        "stack": it.stack,
        "utterance": it.index,
        "prompt_id": it.utt.prompt_id,
        "seed": it.utt.seed,
        "round": it.utt.round,
        "scorer": scorer.name,
        "scorer_version": scorer.version,
        "kind": scorer.kind,
        "reference": scorer.reference,
        "weights_id": scorer.weights_id(),
        "packages": scorer.packages(),
    }

    def failure(why: str) -> ScoreRow:
        return ScoreRow(**row, status="coverage_failure", error=why)

    if it.missing:
        return failure(it.missing)
    audio = _read(it.audio, cache)  # type: ignore[arg-type]
    if isinstance(audio, str):
        return failure(audio)
    ref, ref_rate = None, None
    if scorer.needs_reference_audio:
        if it.reference is None:
            return failure("no other stock recording in this run to use as speaker reference")
        loaded = _read(it.reference, cache)
        if isinstance(loaded, str):
            return failure(f"speaker reference: {loaded}")
        ref, ref_rate = loaded
    try:
        score = scorer.score_record(
            audio[0], audio[1], it.text, ref, reference_sample_rate=ref_rate
        )
    except (CoverageFailure, ValueError) as exc:  # empty, NaN, multi-channel, no speech
        return failure(f"{type(exc).__name__}: {exc}")
    except RuntimeError as exc:
        if "non-finite" not in str(exc):
            raise  # a scorer bug is not the candidate's fault: stop
        return failure(str(exc))
    return ScoreRow(
        **row,
        status="ok",
        values=score.values,
        details=_sealed_details(score.details) if it.sealed else score.details,
        resample=None if score.resample is None else asdict(score.resample),
    )


def _sealed_details(details: dict[str, str]) -> dict[str, str]:
    """A transcript of a holdout recording is (with real weights) the holdout text itself:
    only its hash is kept, so the scores table never holds a holdout prompt in clear."""
    return {k: f"<sealed sha256:{_sha(v)}>" for k, v in details.items()}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- storage


def store_sheet(store: Store, run_id: str, sheet: ScoreSheet) -> int:
    """Add a sheet's rows to run `run_id`; rows already stored are left as they are.
    Returns the number of rows added."""
    return store.add_scores(
        run_id,
        sheet.job_id,
        [r.model_dump() for r in sheet.rows],
        created_at=sheet.created_at,
        protocol_hash=sheet.protocol_hash,
        host=sheet.host,
    )


def load_rows(store: Store, run_id: str) -> list[ScoreRow]:
    """Every stored score of a run's recordings."""
    return [ScoreRow.model_validate(r) for r in store.list_scores(run_id)]


def score_run(
    store: Store,
    run_id: str,
    protocol: Protocol,
    audio_dir: Path | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[ScoreSheet, int]:
    """Score a stored run here (what is already stored is not scored again)."""
    result = store.get_result(run_id)
    run = store.get_run(run_id, utterances=False)
    root = audio_dir or audio_root(result, run.get("result_path"))
    names = tuple(protocol.quality.scorers.values())
    if on_event:
        on_event({"event": "status", "message": f"loading scorers: {', '.join(names)}"})
    scorers = load_scorers(names)
    done = {
        (r.stack, r.utterance, r.scorer, r.scorer_version, r.weights_id)
        for r in load_rows(store, run["id"])
    }
    sheet = score_result(result, protocol, root, scorers, skip=done, on_event=on_event)
    return sheet, store_sheet(store, run["id"], sheet)


# ---------------------------------------------------------------------------- summaries


@dataclass
class StackQuality:
    """A stack's quality metrics (as the protocol defines them) over one run."""

    values: dict[str, float] = field(default_factory=dict)
    per_utterance: dict[str, list[float]] = field(default_factory=dict)
    scored: dict[str, int] = field(default_factory=dict)
    coverage_failures: int = 0
    coverage_detail: list[str] = field(default_factory=list)


def stack_quality(
    result: ResultRecord, rows: Sequence[ScoreRow], protocol: Protocol
) -> dict[str, StackQuality]:
    """Per stack: every protocol metric with data, and its coverage failures.

    Only rows of the protocol's scorers count; rows of one scorer from several versions or
    weights are refused rather than mixed.
    """
    spec = protocol.quality
    wanted = {name: kind for kind, name in spec.scorers.items()}
    rows = [r for r in rows if r.scorer in wanted]
    versions = defaultdict(set)
    for r in rows:
        versions[r.scorer].add((r.scorer_version, r.weights_id))
    mixed = {k: sorted(v) for k, v in versions.items() if len(v) > 1}
    if mixed:
        raise ValueError(f"scores from several versions/weights of one scorer: {mixed}")
    by_stack: dict[str, list[ScoreRow]] = defaultdict(list)
    for r in rows:
        by_stack[r.stack].append(r)
    out = {}
    for sr in result.results:
        q = StackQuality()
        mine = by_stack.get(sr.stack.name, [])
        expected = expected_utterances(result)
        if len(sr.utterances) < expected:  # crashed part-way, or refused: never skipped
            q.coverage_failures += expected - len(sr.utterances)
            q.coverage_detail.append(f"{expected - len(sr.utterances)} utterances not produced")
        failed = [r for r in mine if r.status == "coverage_failure"]
        present = {(r.utterance, r.scorer) for r in mine}
        unscored = {i for i in range(len(sr.utterances)) for n in wanted if (i, n) not in present}
        q.coverage_failures += len({r.utterance for r in failed} | unscored)
        q.coverage_detail += sorted({f"{r.scorer}: {r.error}" for r in failed})[:5]
        if unscored:
            q.coverage_detail.append(f"{len(unscored)} recordings not scored (yet)")
        for name, metric in spec.metrics.items():
            value, per = _aggregate(metric, mine, sr)
            if value is not None:
                q.values[name], q.per_utterance[name], q.scored[name] = value, per, len(per)
        out[sr.stack.name] = q
    return out


def _aggregate(metric: Any, rows: list[ScoreRow], sr: Any) -> tuple[float | None, list[float]]:
    if metric.source == "fidelity":
        value = None if sr.fidelity is None else float(getattr(sr.fidelity, metric.value))
        return value, [] if value is None else [value]
    ok = [r for r in rows if r.kind == metric.source and r.status == "ok"]
    per = [r.values[metric.value] for r in ok if metric.value in r.values]
    if not per:
        return None, []
    if metric.aggregate == "pooled":
        err, ref = POOLED[metric.value]
        total = sum(r.values[ref] for r in ok)
        return (sum(r.values[err] for r in ok) / total if total else None), per
    return math.fsum(per) / len(per), per
