"""Research protocol: protocol versions, scores, holdout audit, champions.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies: a later change to db.models must not rewrite what this revision created.
SCORE_STATUSES = "'ok', 'coverage_failure'"
AUDIT_STATUSES = "'opened', 'accept', 'retain', 'error'"


def upgrade() -> None:
    op.create_table(
        "protocols",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("protocol_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_protocols"),
        sa.UniqueConstraint("name", "version", name="uq_protocols_name"),
        sa.UniqueConstraint("protocol_hash", name="uq_protocols_protocol_hash"),
    )

    op.create_table(
        "scores",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("utterance_id", sa.Integer(), nullable=False),
        sa.Column("scorer", sa.String(64), nullable=False),
        sa.Column("scorer_version", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("reference", sa.Boolean(), nullable=False),
        sa.Column("weights_id", sa.String(80), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("values_json", sa.Text(), nullable=False),
        sa.Column("details_json", sa.Text(), nullable=False),
        sa.Column("resample_json", sa.Text(), nullable=True),
        sa.Column("packages_json", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_scores"),
        sa.ForeignKeyConstraint(
            ["utterance_id"],
            ["utterances.id"],
            name="fk_scores_utterance_id_utterances",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint(
            "utterance_id", "scorer", "scorer_version", "weights_id", name="uq_scores_utterance_id"
        ),
        sa.CheckConstraint(f"status IN ({SCORE_STATUSES})", name="ck_scores_status"),
    )
    op.create_index("ix_scores_utterance_id", "scores", ["utterance_id"])

    op.create_table(
        "holdout_audit",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.DateTime(), nullable=False),
        sa.Column("closed_at", sa.DateTime(), nullable=True),
        sa.Column("workload_name", sa.String(128), nullable=False),
        sa.Column("holdout_hash", sa.String(64), nullable=False),
        sa.Column("stack_name", sa.String(128), nullable=False),
        sa.Column("stack_hash", sa.String(64), nullable=False),
        sa.Column("lineage", sa.Text(), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("flagged", sa.Boolean(), nullable=False),
        sa.Column("flags_json", sa.Text(), nullable=False),
        sa.Column("detail_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_holdout_audit"),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name="fk_holdout_audit_run_id_runs", ondelete="SET NULL"
        ),
        sa.CheckConstraint(f"status IN ({AUDIT_STATUSES})", name="ck_holdout_audit_status"),
    )
    op.create_index("ix_holdout_audit_opened_at", "holdout_audit", ["opened_at"])
    op.create_index("ix_holdout_audit_workload_name", "holdout_audit", ["workload_name"])

    op.create_table(
        "champions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("family", sa.String(32), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("workload_name", sa.String(128), nullable=False),
        sa.Column("hardware", sa.String(255), nullable=False),
        sa.Column("stack_name", sa.String(128), nullable=False),
        sa.Column("stack_hash", sa.String(64), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("decision_id", sa.Integer(), nullable=True),
        sa.Column("protocol_hash", sa.String(64), nullable=False),
        sa.Column("speedup", sa.Float(), nullable=False),
        sa.Column("mlflow_model", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_champions"),
        sa.ForeignKeyConstraint(
            ["decision_id"],
            ["decisions.id"],
            name="fk_champions_decision_id_decisions",
            ondelete="SET NULL",
        ),
    )
    op.create_index("ix_champions_family", "champions", ["family"])


def downgrade() -> None:
    for table in ("champions", "holdout_audit", "scores", "protocols"):
        op.drop_table(table)
