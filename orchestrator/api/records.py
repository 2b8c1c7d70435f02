"""The two documents that cross the worker boundary: a job spec in, a result record out.

Both are plain pydantic models serialised as JSON, so a job can be written on one machine,
run by `orchestrate worker JOB.json` on another (a GPU host with no database or MLflow), and
its result brought back with `orchestrate ingest RESULT.json`. Only torch, transformers,
pydantic and the project are needed to produce a result record.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrate.api.config import SAFE_NAME, ModelSpec, StackSpec, Workload
from orchestrate.api.protocol import Protocol

# A safe name (SAFE_NAME) of at most 56 characters: a re-queued attempt appends "-rN" and the
# store keeps job ids in 64 characters, which PostgreSQL enforces (SQLite would not).
JOB_ID = SAFE_NAME.replace("{0,99}", "{0,55}")

SCHEMA_VERSION = 1


def utcnow() -> datetime:
    return datetime.now(UTC)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b.c": leaf}, for MLflow params and run diffs. Lists stay whole
    (a prompt list is one setting) and an empty dict is a leaf, so a technique without
    parameters still shows."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def write(self, path: Path) -> None:
        """Write atomically: a reader never sees a half-written file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".partial")
        tmp.write_text(self.model_dump_json(indent=2))
        tmp.replace(path)


# ------------------------------------------------------------------------------ job


class JobSpec(Record):
    """Everything a worker needs to measure a set of stacks on one model and workload.

    Stacks in one job share the built model and are measured interleaved (utterance by
    utterance, rotating the stack order each round) so clock and thermal drift hit every
    stack alike. The first stack is the baseline the others are compared against.
    """

    schema_version: int = SCHEMA_VERSION
    # A folder name (runs/<job_id>): a hand-written job.json cannot point it elsewhere.
    job_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12], pattern=JOB_ID)
    model: ModelSpec
    workload: Workload
    stacks: list[StackSpec] = Field(min_length=1)
    protocol: Protocol = Protocol()
    strict: bool = Field(
        False, description="Refuse (instead of skip) techniques this device lacks."
    )
    fidelity_steps: int = Field(
        32, ge=0, description="Teacher-forced steps for next-token fidelity against stock (0: off)."
    )
    output_dir: str = Field(
        description="Where the worker writes WAVs (relative to its cwd or absolute)."
    )
    code_sha: str | None = None
    # What the SHA alone misses, recorded at planning so `ingest` elsewhere recomputes the
    # same identity. None where unknown (old records; ORCHESTRATE_CODE_SHA without .git).
    code_dirty: bool | None = Field(
        None, description="Uncommitted changes (tracked, or untracked and not ignored)."
    )
    code_diff_hash: str | None = Field(None, description="Hash of those changes; None: clean.")
    technique_code: dict[str, dict[str, str | int | None]] = Field(
        default_factory=dict,
        description="technique -> version, distribution and version, source file hash.",
    )
    # A resumed job (`orchestrate run --resume`): the same measurement as the run it
    # continues, which the worker completes instead of starting over. Not part of the
    # identity: a resumed run measures the same experiment.
    resumed_from: str | None = Field(
        None, description="Run id of the INTERRUPTED or FAILED run this job continues."
    )
    carried: dict[str, list[UtteranceRecord]] = Field(
        default_factory=dict,
        description="stack -> utterances that run measured (marked resumed); not re-timed.",
    )
    # A holdout job (the gate's) carries placeholders, never holdout texts: the worker and
    # the scorers read them from this file, hash-checked (orchestrate.api.sealed.resolve).
    sealed_file: str | None = Field(
        None, description="Sealed holdout file (relative to the checkout, or absolute)."
    )
    # Not part of the identity: measured after the timed rounds, it never moves a headline.
    profile_slots: bool = Field(
        False, description="Also time each stack's slots (metrics slot_ms.<slot>, ms per step)."
    )
    # Not part of the identity either, for the same reason. Counting a host-bound loop under
    # the profiler is slow (stock at real shape: ~25 s a job on the H200); an exploration's
    # dev and fresh jobs count none (no decision reads the counts).
    count_launches: list[str] | None = Field(
        None, description="Stacks whose kernels and launches per step are counted (None: all)."
    )

    @property
    def baseline(self) -> StackSpec:
        return self.stacks[0]


# --------------------------------------------------------------------------- result


class EnvironmentInfo(Record):
    hostname: str
    platform: str
    python: str
    torch: str
    transformers: str
    cuda: str | None = None
    device_name: str
    driver: str | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    power_w: float | None = None
    gpu_count: int = 0
    matmul_tflop_s: float | None = Field(
        None, description="Measured dense matmul throughput in the model's dtype."
    )
    copy_gb_s: float | None = Field(
        None, description="Measured copy bandwidth (bytes read + written): the floor's ceiling."
    )
    cpu_count: int = Field(description="Logical cores (os.cpu_count).")
    # The host CPU drives the token loop's launches and syncs, so a stock figure names it.
    cpu_model: str | None = Field(None, description="Host CPU model (/proc/cpuinfo, lscpu).")
    cpu_max_mhz: float | None = Field(
        None, description="Host CPU max clock, MHz (a VM: the clock /proc/cpuinfo reports)."
    )
    cpu_single_thread_ms: float | None = Field(
        None, description="A fixed pure-Python loop, median ms: this host's single-thread speed."
    )
    git_sha: str | None = None
    git_dirty: bool | None = None
    model_config_hash: str
    packages: dict[str, str] = Field(default_factory=dict)
    # A warm worker keeps its built model between jobs of the same model (worker.ModelCache);
    # each job still builds its engines, captures its graphs and warms up.
    model_reused: bool | None = Field(
        None, description="The model came built from the worker's previous job."
    )
    model_build_s: float | None = Field(
        None, description="Seconds the model build took (reused: the seconds this job saved)."
    )


class UtteranceRecord(Record):
    """One timed synthesis: one prompt, one seed, one stack."""

    prompt_id: str
    seed: int
    round: int = Field(description="Interleaving round (0-based); same round = same conditions.")
    latency_s: float = Field(description="Prompt construction -> completed CPU waveform.")
    lm_s: float = Field(description="Token generation (prefill + decode loop).")
    codec_s: float = Field(description="Codec decode to a CPU waveform.")
    prefill_s: float | None = None
    time_to_first_audio_s: float | None = Field(
        None, description="Until the first 80 ms frame is decoded (streaming-style), if measured."
    )
    prompt_tokens: int
    new_tokens: int
    frames: int
    audio_s: float
    stop_reason: Literal["end_token", "stop_head", "length_policy", "token_cap"]
    audio_path: str | None = None
    forward_passes: int | None = Field(
        None, description="Whole-sequence forwards run (OmniVoice: unmasking steps)."
    )
    forward_bytes: float | None = Field(
        None, description="Least bytes one of those forwards must read (weights once)."
    )
    forward_flops: float | None = Field(None, description="FLOPs of one of those forwards.")
    # Integrity, computed on the waveform (scoring proper runs later, on saved audio).
    finite: bool = True
    peak_abs: float = 0.0
    clipped_samples: int = 0
    resumed: bool = Field(
        False, description="Measured by the run this one resumed (carried over, not re-timed)."
    )
    host_loop_ms: float | None = Field(
        None,
        description="The timing worker's host single-thread loop (environment.single_thread_ms)"
        ": the segments of a resumed run can run on hosts of different speed.",
    )
    timed_by: str | None = Field(
        None,
        description="Job id of the worker that timed it: a resumed run has one per segment, "
        "and a pair is formed only within one (measured back to back).",
    )


class FidelityRecord(Record):
    """Next-token distributions of a stack against stock, teacher-forced on one sequence."""

    steps: int
    max_abs_logit_diff: float
    mean_kl: float
    max_kl: float
    top1_agreement: float
    topk_agreement: float = Field(description="Mean Jaccard overlap of the top-k candidate sets.")
    within_tolerance: bool = Field(
        description="The verdict over every part measured: the logits, and the sampler and "
        "loop where a technique fills them."
    )
    tolerance: float
    logits_within_tolerance: bool | None = Field(
        None,
        description="The teacher-forced logits alone (None: older records, or no sampler or "
        "loop test changed the verdict).",
    )
    noise_floor_max_abs: float | None = Field(
        None, description="Half precision: stock's own max |logit diff| from an fp32 upcast."
    )
    noise_floor_kl: float | None = Field(
        None, description="Half precision: stock's own mean KL from an fp32 upcast."
    )
    support_kl: float | None = Field(
        None,
        description="Mean KL against stock renormalised over the columns the stack can emit "
        "(a restricted head): what the stack changes besides the restriction itself.",
    )
    support_top1: float | None = Field(
        None, description="Top-1 agreement with stock's argmax over the stack's columns."
    )
    covers: list[str] | None = Field(
        None, description="Engine slots this comparison ran (None: not said, older records)."
    )
    not_covered: dict[str, str] = Field(
        default_factory=dict,
        description="slot -> technique the stack put in a slot this comparison never ran: "
        "its exactness there is the plugin's word, not measured.",
    )
    sampler_tv: float | None = Field(
        None,
        description="Sampler slot, when a technique fills it: the largest total-variation "
        "distance, over a few fixed head outputs, between the stack's sampler's draws and "
        "stock's sampler's draws on the same logits (None: not measured).",
    )
    sampler_tv_bound: float | None = Field(
        None,
        description="The TV two samplers with one distribution exceed by chance with "
        "probability < 1e-6 at these draws; above it the sampler is not within tolerance.",
    )
    sampler_draws: int | None = Field(
        None, description="Draws per sampler per head output behind sampler_tv."
    )
    loop_tokens_identical: bool | None = Field(
        None,
        description="Loop slot, when a technique fills it: the stack's loop gave the same "
        "tokens as stock's loop over the stack's own parts, from the same seed (None: not "
        "measured).",
    )
    loop_first_divergence: int | None = Field(
        None, description="The first token index where the two loops differ; None if none."
    )
    codec_rel_diff: float | None = Field(
        None,
        description="Codec slot, when a technique fills it: max |difference| between its "
        "decoding of stock's codes and stock's, over the std of stock's (None: not measured).",
    )
    loop_note: str | None = Field(
        None, description="What the loop comparison ran, and what a difference can mean."
    )


class IdenticalAudio(Record):
    """Two utterances of one stack, from different inputs (prompt text or seed), whose
    waveforms are the same: the audio does not depend on its input."""

    a: str = Field(description="prompt/seed of the first utterance")
    b: str
    round_a: int
    round_b: int
    differs_in: Literal["prompt", "seed", "prompt and seed"]
    max_abs_diff: float = Field(description="After cutting both to the shorter length.")
    correlation: float | None = Field(None, description="None when either is constant.")


class StackResult(Record):
    stack: StackSpec
    status: Literal["ok", "partial", "failed", "refused"]
    applied: list[str] = Field(
        default_factory=list, description="name@version of applied techniques"
    )
    skipped: dict[str, str] = Field(default_factory=dict, description="technique -> why skipped")
    exact: bool = Field(True, description="False when any applied technique is approximate.")
    error: str | None = None
    setup_s: float = Field(0.0, description="Engine build, graph capture, compile (not timed).")
    warmup_s: float = 0.0
    peak_memory_bytes: int | None = None
    utterances: list[UtteranceRecord] = Field(default_factory=list)
    fidelity: FidelityRecord | None = None
    fidelity_error: str | None = Field(
        None, description="Why this stack has no fidelity record (its own failure)."
    )
    invalid: str | None = Field(
        None, description="Why its timings cannot be real (faster than its floor); never accepted."
    )
    audio_independent_of_input: IdenticalAudio | None = Field(
        None, description="Two of its utterances from different inputs with the same audio."
    )
    metrics: dict[str, float] = Field(default_factory=dict)


class ResultRecord(Record):
    schema_version: int = SCHEMA_VERSION
    job: JobSpec
    status: Literal["finished", "partial", "failed"]
    started_at: datetime
    finished_at: datetime
    environment: EnvironmentInfo
    results: list[StackResult]
    error: str | None = None

    @classmethod
    def read(cls, path: Path) -> ResultRecord:
        return cls.model_validate_json(Path(path).read_text())
