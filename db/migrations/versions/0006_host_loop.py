"""Per utterance, the worker that timed it and its host's speed (its single-thread loop): a
resumed run's segments can run on hosts of different speed, and pairs form within one.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("utterances") as batch:
        batch.add_column(sa.Column("host_loop_ms", sa.Float(), nullable=True))
        batch.add_column(sa.Column("timed_by", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("utterances") as batch:
        batch.drop_column("timed_by")
        batch.drop_column("host_loop_ms")
