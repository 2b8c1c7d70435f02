"""Explorations (`orchestrate explore`) and their candidates: the exploration's journal.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies: a later change to db.models must not rewrite what this revision created.
EXPLORATION_STATUSES = "'RUNNING', 'FINISHED', 'INTERRUPTED', 'FAILED'"
CANDIDATE_STATUSES = "'open', 'decided'"
CANDIDATE_DECISIONS = (
    "'drop', 'remeasure', 'gate', 'accept', 'retain', 'invalid', 'error', 'duplicate'"
)


def upgrade() -> None:
    op.create_table(
        "explorations",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("model_json", sa.Text(), nullable=False),
        sa.Column("workload_name", sa.String(128), nullable=False),
        sa.Column("workload_json", sa.Text(), nullable=False),
        sa.Column("hardware", sa.String(255), nullable=False),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("protocol_json", sa.Text(), nullable=False),
        sa.Column("root_json", sa.Text(), nullable=False),
        sa.Column("champion_json", sa.Text(), nullable=False),
        sa.Column("champion_headline", sa.Float(), nullable=True),
        sa.Column("champion_lo", sa.Float(), nullable=True),
        sa.Column("champion_hi", sa.Float(), nullable=True),
        sa.Column("options_json", sa.Text(), nullable=False),
        sa.Column("stop_reason", sa.Text(), nullable=True),
        sa.Column("elapsed_s", sa.Float(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_explorations"),
        sa.CheckConstraint(f"status IN ({EXPLORATION_STATUSES})", name="ck_explorations_status"),
    )
    op.create_index("ix_explorations_started_at", "explorations", ["started_at"])

    op.create_table(
        "exploration_candidates",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("exploration_id", sa.String(32), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("decided_at", sa.DateTime(), nullable=True),
        sa.Column("proposer", sa.String(64), nullable=False),
        sa.Column("change", sa.Text(), nullable=False),
        sa.Column("proposal_reason", sa.Text(), nullable=False),
        sa.Column("parent_name", sa.String(128), nullable=True),
        sa.Column("parent_hash", sa.String(64), nullable=True),
        sa.Column("stack_name", sa.String(128), nullable=True),
        sa.Column("stack_hash", sa.String(64), nullable=True),
        sa.Column("spec_json", sa.Text(), nullable=True),
        sa.Column("identity", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("phase", sa.String(16), nullable=True),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("phase_started_at", sa.DateTime(), nullable=True),
        sa.Column("decision", sa.String(16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("quality_path", sa.Text(), nullable=True),
        sa.Column("headline", sa.Float(), nullable=True),
        sa.Column("headline_lo", sa.Float(), nullable=True),
        sa.Column("headline_hi", sa.Float(), nullable=True),
        sa.Column("vs_parent", sa.Float(), nullable=True),
        sa.Column("vs_parent_lo", sa.Float(), nullable=True),
        sa.Column("vs_parent_hi", sa.Float(), nullable=True),
        sa.Column("run_ids_json", sa.Text(), nullable=False),
        sa.Column("steps_json", sa.Text(), nullable=False),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_exploration_candidates"),
        sa.ForeignKeyConstraint(
            ["exploration_id"],
            ["explorations.id"],
            name="fk_exploration_candidates_exploration_id_explorations",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint(
            "exploration_id", "seq", name="uq_exploration_candidates_exploration_id"
        ),
        sa.CheckConstraint(
            f"status IN ({CANDIDATE_STATUSES})", name="ck_exploration_candidates_status"
        ),
        sa.CheckConstraint(
            f"decision IS NULL OR decision IN ({CANDIDATE_DECISIONS})",
            name="ck_exploration_candidates_decision",
        ),
    )
    op.create_index(
        "ix_exploration_candidates_exploration_id", "exploration_candidates", ["exploration_id"]
    )
    op.create_index(
        "ix_exploration_candidates_stack_hash", "exploration_candidates", ["stack_hash"]
    )
    op.create_index("ix_exploration_candidates_identity", "exploration_candidates", ["identity"])


def downgrade() -> None:
    for table in ("exploration_candidates", "explorations"):
        op.drop_table(table)
