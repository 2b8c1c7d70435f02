"""Tables of the orchestrator database.

A run is one comparison of stacks measured in one job; each stack inside it is a
stack_result with its utterances and metrics. Stack definitions are shared between runs
(deduplicated by content hash). Decisions and failures are ledgers that outlive runs.

Any change here needs a new revision in db/migrations/versions (tests compare the two).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

RUN_STATUSES = ("RUNNING", "FINISHED", "PARTIAL", "FAILED", "INTERRUPTED")
STACK_STATUSES = ("ok", "partial", "failed", "refused")
VERDICTS = ("accept", "retain")
FAILURE_CAUSES = ("slower", "gate", "crash", "oom", "compile", "refused", "interrupted", "other")

# Deterministic constraint names, so later migrations (SQLite batch mode) can refer to them.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC; always returns timezone-aware datetimes (SQLite drops the zone)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (CheckConstraint(one_of("status", RUN_STATUSES), name="status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # Hash of model + workload + stacks + protocol + code sha: equal identities measured
    # the same thing, so a FINISHED one can be reused instead of re-measured.
    identity: Mapped[str] = mapped_column(String(64), index=True)
    # One job is recorded once (a second ingest of the same result is refused).
    job_id: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    family: Mapped[str] = mapped_column(String(32), index=True)
    model_json: Mapped[str] = mapped_column(Text)
    workload_name: Mapped[str] = mapped_column(String(128), index=True)
    workload_json: Mapped[str] = mapped_column(Text)
    protocol_hash: Mapped[str] = mapped_column(String(64))
    protocol_version: Mapped[int] = mapped_column(Integer)
    code_sha: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    # The orchestrator process owning a RUNNING row: if it is gone, the run was interrupted.
    pid: Mapped[int | None] = mapped_column(Integer)
    # The whole job spec, so a run can be re-planned or re-run exactly.
    job_json: Mapped[str] = mapped_column(Text)
    # Set exactly when a worker's result has been recorded (every result has one).
    environment_json: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    result_path: Mapped[str | None] = mapped_column(Text)
    baseline_stack: Mapped[str] = mapped_column(String(128))

    stack_results: Mapped[list[StackResultRow]] = relationship(
        back_populates="run", order_by="StackResultRow.position", cascade="all, delete-orphan"
    )


class Stack(Base):
    __tablename__ = "stacks"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    family: Mapped[str] = mapped_column(String(32))
    spec_hash: Mapped[str] = mapped_column(String(64), unique=True)
    spec_json: Mapped[str] = mapped_column(Text)


class StackResultRow(Base):
    __tablename__ = "stack_results"
    __table_args__ = (
        UniqueConstraint("run_id", "position"),
        CheckConstraint(one_of("status", STACK_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    stack_id: Mapped[int] = mapped_column(ForeignKey("stacks.id"), index=True)
    position: Mapped[int] = mapped_column(Integer)  # 0 is the baseline
    status: Mapped[str] = mapped_column(String(16))
    exact: Mapped[bool] = mapped_column(Boolean)
    applied_json: Mapped[str] = mapped_column(Text)
    skipped_json: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    setup_s: Mapped[float] = mapped_column(Float)
    warmup_s: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    fidelity_json: Mapped[str | None] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))

    run: Mapped[Run] = relationship(back_populates="stack_results")
    stack: Mapped[Stack] = relationship()
    utterances: Mapped[list[Utterance]] = relationship(
        order_by="Utterance.position", cascade="all, delete-orphan"
    )
    metrics: Mapped[list[Metric]] = relationship(cascade="all, delete-orphan")


class Utterance(Base):
    __tablename__ = "utterances"
    __table_args__ = (UniqueConstraint("stack_result_id", "position"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    stack_result_id: Mapped[int] = mapped_column(
        ForeignKey("stack_results.id", ondelete="CASCADE"), index=True
    )
    position: Mapped[int] = mapped_column(Integer)  # order in the result record
    prompt_id: Mapped[str] = mapped_column(String(128))
    seed: Mapped[int] = mapped_column(BigInteger)
    round: Mapped[int] = mapped_column(Integer)
    latency_s: Mapped[float] = mapped_column(Float)
    lm_s: Mapped[float] = mapped_column(Float)
    codec_s: Mapped[float] = mapped_column(Float)
    prefill_s: Mapped[float | None] = mapped_column(Float)
    time_to_first_audio_s: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    new_tokens: Mapped[int] = mapped_column(Integer)
    frames: Mapped[int] = mapped_column(Integer)
    audio_s: Mapped[float] = mapped_column(Float)
    stop_reason: Mapped[str] = mapped_column(String(32))
    audio_path: Mapped[str | None] = mapped_column(Text)
    finite: Mapped[bool] = mapped_column(Boolean)
    peak_abs: Mapped[float] = mapped_column(Float)
    clipped_samples: Mapped[int] = mapped_column(Integer)
    forward_passes: Mapped[int | None] = mapped_column(Integer)
    forward_bytes: Mapped[float | None] = mapped_column(Float)
    forward_flops: Mapped[float | None] = mapped_column(Float)
    host_loop_ms: Mapped[float | None] = mapped_column(Float)  # revision 0006
    timed_by: Mapped[str | None] = mapped_column(String(64))  # revision 0006


class Metric(Base):
    __tablename__ = "metrics"

    stack_result_id: Mapped[int] = mapped_column(
        ForeignKey("stack_results.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[float] = mapped_column(Float)


class Decision(Base):
    """A verdict of the accept/retain protocol on one measured stack."""

    __tablename__ = "decisions"
    __table_args__ = (CheckConstraint(one_of("verdict", VERDICTS), name="verdict"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    stack_result_id: Mapped[int] = mapped_column(
        ForeignKey("stack_results.id", ondelete="CASCADE"), index=True
    )
    family: Mapped[str] = mapped_column(String(32))
    workload_name: Mapped[str] = mapped_column(String(128))
    hardware: Mapped[str] = mapped_column(String(255))
    verdict: Mapped[str] = mapped_column(String(16))
    reasons_json: Mapped[str] = mapped_column(Text)
    protocol_hash: Mapped[str] = mapped_column(String(64))


class Failure(Base):
    """Failure ledger: what failed, where, and why (kept even when runs are deleted)."""

    __tablename__ = "failures"
    __table_args__ = (CheckConstraint(one_of("cause", FAILURE_CAUSES), name="cause"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    run_id: Mapped[str | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"), index=True
    )
    stack_name: Mapped[str | None] = mapped_column(String(128))
    cause: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str] = mapped_column(Text)


def columns(row: Base) -> dict[str, Any]:
    """A row's column values as a plain dict (no ORM state leaks to callers)."""
    return {c.key: getattr(row, c.key) for c in row.__table__.columns}


# ---------------------------------------------------- research protocol (revision 0002)

SCORE_STATUSES = ("ok", "coverage_failure")
AUDIT_STATUSES = ("opened", "accept", "retain", "error")


class ProtocolRow(Base):
    """Every protocol version seen: (name, version) may never change content."""

    __tablename__ = "protocols"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    protocol_hash: Mapped[str] = mapped_column(String(64), unique=True)
    protocol_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class ScoreEntry(Base):
    """One scorer's verdict on one saved recording, or why it could not be scored."""

    __tablename__ = "scores"
    __table_args__ = (
        # The same scorer, version and weights give the same score: stored once.
        UniqueConstraint("utterance_id", "scorer", "scorer_version", "weights_id"),
        CheckConstraint(one_of("status", SCORE_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    utterance_id: Mapped[int] = mapped_column(
        ForeignKey("utterances.id", ondelete="CASCADE"), index=True
    )
    scorer: Mapped[str] = mapped_column(String(64))
    scorer_version: Mapped[str] = mapped_column(String(32))
    kind: Mapped[str] = mapped_column(String(16))
    reference: Mapped[bool] = mapped_column(Boolean)
    weights_id: Mapped[str] = mapped_column(String(80))
    status: Mapped[str] = mapped_column(String(24))
    values_json: Mapped[str] = mapped_column(Text)
    details_json: Mapped[str] = mapped_column(Text)
    resample_json: Mapped[str | None] = mapped_column(Text)
    packages_json: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    protocol_hash: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))


class HoldoutAudit(Base):
    """Every time sealed holdout prompts were opened: for which stack, and what came of it."""

    __tablename__ = "holdout_audit"
    __table_args__ = (CheckConstraint(one_of("status", AUDIT_STATUSES), name="status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    opened_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    workload_name: Mapped[str] = mapped_column(String(128), index=True)
    holdout_hash: Mapped[str] = mapped_column(String(64))
    stack_name: Mapped[str] = mapped_column(String(128))
    stack_hash: Mapped[str] = mapped_column(String(64))
    # Technique names in order: a re-tuned stack keeps its lineage while its hash changes.
    lineage: Mapped[str] = mapped_column(Text)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    protocol_hash: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    flagged: Mapped[bool] = mapped_column(Boolean)
    flags_json: Mapped[str] = mapped_column(Text)
    detail_json: Mapped[str] = mapped_column(Text)


class Champion(Base):
    """An accepted stack: the champion for (family, model, workload, hardware) from then on
    (the newest row of a key is the current one; older rows are its history)."""

    __tablename__ = "champions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    family: Mapped[str] = mapped_column(String(32), index=True)
    model: Mapped[str] = mapped_column(String(255))
    workload_name: Mapped[str] = mapped_column(String(128))
    hardware: Mapped[str] = mapped_column(String(255))
    stack_name: Mapped[str] = mapped_column(String(128))
    stack_hash: Mapped[str] = mapped_column(String(64))
    spec_json: Mapped[str] = mapped_column(Text)
    decision_id: Mapped[int | None] = mapped_column(ForeignKey("decisions.id", ondelete="SET NULL"))
    protocol_hash: Mapped[str] = mapped_column(String(64))
    speedup: Mapped[float] = mapped_column(Float)
    mlflow_model: Mapped[str | None] = mapped_column(String(255))


# ------------------------------------------------------ explorations (revision 0004)

EXPLORATION_STATUSES = ("RUNNING", "FINISHED", "INTERRUPTED", "FAILED")
# orchestrate.api.proposer.Decision, the ledger's vocabulary (NULL while a candidate is open).
CANDIDATE_DECISIONS = (
    "drop",
    "remeasure",
    "gate",
    "accept",
    "retain",
    "invalid",
    "error",
    "duplicate",
    "superseded",  # revision 0005
)
CANDIDATE_STATUSES = ("open", "decided")


class Exploration(Base):
    """One `orchestrate explore`: what it explores (model, workload, protocol, hardware), its
    options, its champion as it moves, and why it stopped. Its candidates are the journal."""

    __tablename__ = "explorations"
    __table_args__ = (CheckConstraint(one_of("status", EXPLORATION_STATUSES), name="status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    status: Mapped[str] = mapped_column(String(16))
    # The process driving it: a RUNNING row whose process is gone was interrupted.
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    family: Mapped[str] = mapped_column(String(32))
    model_json: Mapped[str] = mapped_column(Text)
    workload_name: Mapped[str] = mapped_column(String(128))
    workload_json: Mapped[str] = mapped_column(Text)
    hardware: Mapped[str] = mapped_column(String(255))
    protocol_hash: Mapped[str] = mapped_column(String(64))
    protocol_json: Mapped[str] = mapped_column(Text)
    root_json: Mapped[str] = mapped_column(Text)  # the --from stack
    champion_json: Mapped[str] = mapped_column(Text)
    champion_headline: Mapped[float | None] = mapped_column(Float)  # paired, vs stock
    champion_lo: Mapped[float | None] = mapped_column(Float)
    champion_hi: Mapped[float | None] = mapped_column(Float)
    options_json: Mapped[str] = mapped_column(Text)  # budget, proposers, patience, paths
    stop_reason: Mapped[str | None] = mapped_column(Text)
    elapsed_s: Mapped[float] = mapped_column(Float)  # over every session (resumes add up)
    jobs: Mapped[int] = mapped_column(Integer)  # worker jobs submitted, gate runs included
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))


class ExplorationCandidate(Base):
    """One proposal of an exploration, written `open` before its first job and `decided`
    after its last: the journal `explore --resume` continues from. `phase` and `job_id` name
    the job in flight; `steps_json` holds every decision taken on it with its numbers."""

    __tablename__ = "exploration_candidates"
    __table_args__ = (
        UniqueConstraint("exploration_id", "seq"),
        CheckConstraint(one_of("status", CANDIDATE_STATUSES), name="status"),
        CheckConstraint(
            f"decision IS NULL OR {one_of('decision', CANDIDATE_DECISIONS)}", name="decision"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    exploration_id: Mapped[str] = mapped_column(
        ForeignKey("explorations.id", ondelete="CASCADE"), index=True
    )
    seq: Mapped[int] = mapped_column(Integer)  # 1, 2, ... in the order proposed
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    decided_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    proposer: Mapped[str] = mapped_column(String(64))
    change: Mapped[str] = mapped_column(Text)  # "+audio_head", "-pdl", ...
    proposal_reason: Mapped[str] = mapped_column(Text)
    parent_name: Mapped[str | None] = mapped_column(String(128))
    parent_hash: Mapped[str | None] = mapped_column(String(64))
    # NULL for a proposer that failed (crash, timeout, malformed output): no stack to try.
    stack_name: Mapped[str | None] = mapped_column(String(128))
    stack_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    spec_json: Mapped[str | None] = mapped_column(Text)
    # Stack + code + protocol + hardware: dedup happens on it before anything is submitted.
    identity: Mapped[str | None] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16))
    phase: Mapped[str | None] = mapped_column(String(16))  # dev | fresh | gate
    job_id: Mapped[str | None] = mapped_column(String(64))  # the job in flight
    phase_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    decision: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    quality_path: Mapped[str | None] = mapped_column(Text)
    headline: Mapped[float | None] = mapped_column(Float)  # paired speedup vs stock
    headline_lo: Mapped[float | None] = mapped_column(Float)
    headline_hi: Mapped[float | None] = mapped_column(Float)
    vs_parent: Mapped[float | None] = mapped_column(Float)  # paired speedup vs its parent
    vs_parent_lo: Mapped[float | None] = mapped_column(Float)
    vs_parent_hi: Mapped[float | None] = mapped_column(Float)
    run_ids_json: Mapped[str] = mapped_column(Text)
    steps_json: Mapped[str] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))


JOB_STATES = ("PENDING", "RUNNING", "DONE", "FAILED", "CANCELLED")


class QueuedJob(Base):
    """A planned job waiting for, held by, or done by a pool worker (`orchestrate submit`,
    `orchestrate workers`). The job's own JSON is its payload; `requirements_json` says what
    a worker must have to claim it. `attempts` counts claims: a worker that dies mid-job
    leaves its claim to be re-queued (up to `max_attempts`); `run_id` is set in the same
    transaction that records the run's result, so a result is ingested once per job."""

    __tablename__ = "jobs"
    __table_args__ = (CheckConstraint(one_of("state", JOB_STATES), name="state"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the JobSpec's job_id
    state: Mapped[str] = mapped_column(String(16), index=True)
    priority: Mapped[int] = mapped_column(Integer)  # higher first; equal: oldest first
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    submitted_by: Mapped[str] = mapped_column(String(255))  # host:pid of the submitter
    label: Mapped[str] = mapped_column(Text)  # model, workload, stacks: for `queue`
    schema_version: Mapped[int] = mapped_column(Integer)
    job_json: Mapped[str] = mapped_column(Text)
    requirements_json: Mapped[str] = mapped_column(Text)
    options_json: Mapped[str] = mapped_column(Text)  # force, track, recordings_from
    attempts: Mapped[int] = mapped_column(Integer)
    max_attempts: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(String(128))  # the holder while RUNNING
    device: Mapped[str | None] = mapped_column(String(255))  # where the last attempt ran
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    progress: Mapped[str | None] = mapped_column(Text)  # the worker's last status line
    run_id: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)
    history_json: Mapped[str] = mapped_column(Text)  # one entry per attempt: who, how it ended


class PoolWorker(Base):
    """A live member of a worker pool (`orchestrate workers`): one per GPU (or CPU slot),
    heart-beating while it lives; the row goes when it stops cleanly. A row whose process is
    gone (same host) or whose heartbeat is stale is dead, and its claim is re-queued."""

    __tablename__ = "pool_workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # host:pid:slot
    pool_id: Mapped[str] = mapped_column(String(64), index=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    slot: Mapped[str] = mapped_column(String(32))  # "0" (a GPU index) or "cpu:1"
    capabilities_json: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime())
    job_id: Mapped[str | None] = mapped_column(String(64))
