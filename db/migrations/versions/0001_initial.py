"""Initial schema: runs, stacks, stack results, utterances, metrics, decisions, failures.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies: a later change to db.models must not rewrite what this revision created.
RUN_STATUSES = "'RUNNING', 'FINISHED', 'PARTIAL', 'FAILED', 'INTERRUPTED'"
STACK_STATUSES = "'ok', 'partial', 'failed', 'refused'"
VERDICTS = "'accept', 'retain'"
CAUSES = "'slower', 'gate', 'crash', 'oom', 'compile', 'refused', 'interrupted', 'other'"


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("identity", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("model_json", sa.Text(), nullable=False),
        sa.Column("workload_name", sa.String(128), nullable=False),
        sa.Column("workload_json", sa.Text(), nullable=False),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("protocol_version", sa.Integer(), nullable=False),
        sa.Column("code_sha", sa.String(64), nullable=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("job_json", sa.Text(), nullable=False),
        sa.Column("environment_json", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.Column("result_path", sa.Text(), nullable=True),
        sa.Column("baseline_stack", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
        sa.UniqueConstraint("job_id", name="uq_runs_job_id"),
        sa.CheckConstraint(f"status IN ({RUN_STATUSES})", name="ck_runs_status"),
    )
    op.create_index("ix_runs_identity", "runs", ["identity"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_family", "runs", ["family"])
    op.create_index("ix_runs_workload_name", "runs", ["workload_name"])

    op.create_table(
        "stacks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stacks"),
        sa.UniqueConstraint("spec_hash", name="uq_stacks_spec_hash"),
    )
    op.create_index("ix_stacks_name", "stacks", ["name"])

    op.create_table(
        "stack_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("stack_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("exact", sa.Boolean(), nullable=False),
        sa.Column("applied_json", sa.Text(), nullable=False),
        sa.Column("skipped_json", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("setup_s", sa.Float(), nullable=False),
        sa.Column("warmup_s", sa.Float(), nullable=False),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("fidelity_json", sa.Text(), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_stack_results"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_stack_results_run_id_runs", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["stack_id"], ["stacks.id"], name="fk_stack_results_stack_id_stacks"
        ),
        sa.UniqueConstraint("run_id", "position", name="uq_stack_results_run_id"),
        sa.CheckConstraint(f"status IN ({STACK_STATUSES})", name="ck_stack_results_status"),
    )
    op.create_index("ix_stack_results_run_id", "stack_results", ["run_id"])
    op.create_index("ix_stack_results_stack_id", "stack_results", ["stack_id"])

    op.create_table(
        "utterances",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("stack_result_id", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("prompt_id", sa.String(128), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.Column("lm_s", sa.Float(), nullable=False),
        sa.Column("codec_s", sa.Float(), nullable=False),
        sa.Column("prefill_s", sa.Float(), nullable=True),
        sa.Column("time_to_first_audio_s", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("new_tokens", sa.Integer(), nullable=False),
        sa.Column("frames", sa.Integer(), nullable=False),
        sa.Column("audio_s", sa.Float(), nullable=False),
        sa.Column("stop_reason", sa.String(32), nullable=False),
        sa.Column("audio_path", sa.Text(), nullable=True),
        sa.Column("finite", sa.Boolean(), nullable=False),
        sa.Column("peak_abs", sa.Float(), nullable=False),
        sa.Column("clipped_samples", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_utterances"),
        sa.ForeignKeyConstraint(
            ["stack_result_id"],
            ["stack_results.id"],
            name="fk_utterances_stack_result_id_stack_results",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("stack_result_id", "position", name="uq_utterances_stack_result_id"),
    )
    op.create_index("ix_utterances_stack_result_id", "utterances", ["stack_result_id"])

    op.create_table(
        "metrics",
        sa.Column("stack_result_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("stack_result_id", "key", name="pk_metrics"),
        sa.ForeignKeyConstraint(
            ["stack_result_id"],
            ["stack_results.id"],
            name="fk_metrics_stack_result_id_stack_results",
            ondelete="CASCADE",
        ),
    )

    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("stack_result_id", sa.Integer(), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("workload_name", sa.String(128), nullable=False),
        sa.Column("hardware", sa.String(255), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("reasons_json", sa.Text(), nullable=False),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
        sa.ForeignKeyConstraint(
            ["stack_result_id"],
            ["stack_results.id"],
            name="fk_decisions_stack_result_id_stack_results",
            ondelete="CASCADE",
        ),
        sa.CheckConstraint(f"verdict IN ({VERDICTS})", name="ck_decisions_verdict"),
    )
    op.create_index("ix_decisions_stack_result_id", "decisions", ["stack_result_id"])

    op.create_table(
        "failures",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("stack_name", sa.String(128), nullable=True),
        sa.Column("cause", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_failures"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_failures_run_id_runs", ondelete="SET NULL"
        ),
        sa.CheckConstraint(f"cause IN ({CAUSES})", name="ck_failures_cause"),
    )
    op.create_index("ix_failures_created_at", "failures", ["created_at"])
    op.create_index("ix_failures_run_id", "failures", ["run_id"])


def downgrade() -> None:
    for table in ("failures", "decisions", "metrics", "utterances", "stack_results"):
        op.drop_table(table)
    op.drop_table("stacks")
    op.drop_table("runs")
