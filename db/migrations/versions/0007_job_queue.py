"""The durable job queue (`orchestrate submit`, `orchestrate workers`): queued jobs and the
live members of worker pools.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A frozen copy: a later change to db.models must not rewrite what this revision created.
STATES = "state IN ('PENDING', 'RUNNING', 'DONE', 'FAILED', 'CANCELLED')"


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("submitted_at", sa.DateTime(), nullable=False),
        sa.Column("submitted_by", sa.String(255), nullable=False),
        sa.Column("label", sa.Text(), nullable=False),
        sa.Column("schema_version", sa.Integer(), nullable=False),
        sa.Column("job_json", sa.Text(), nullable=False),
        sa.Column("requirements_json", sa.Text(), nullable=False),
        sa.Column("options_json", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=True),
        sa.Column("device", sa.String(255), nullable=True),
        sa.Column("claimed_at", sa.DateTime(), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("progress", sa.Text(), nullable=True),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("history_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.CheckConstraint(STATES, name="ck_jobs_state"),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_index("ix_jobs_submitted_at", "jobs", ["submitted_at"])
    op.create_table(
        "pool_workers",
        sa.Column("id", sa.String(128), nullable=False),
        sa.Column("pool_id", sa.String(64), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("slot", sa.String(32), nullable=False),
        sa.Column("capabilities_json", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_pool_workers"),
    )
    op.create_index("ix_pool_workers_pool_id", "pool_workers", ["pool_id"])


def downgrade() -> None:
    op.drop_table("pool_workers")
    op.drop_table("jobs")
