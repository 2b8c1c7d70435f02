"""Per-utterance whole-sequence forwards and their floor quantities (OmniVoice steps).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("utterances") as batch:
        batch.add_column(sa.Column("forward_passes", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("forward_bytes", sa.Float(), nullable=True))
        batch.add_column(sa.Column("forward_flops", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("utterances") as batch:
        batch.drop_column("forward_flops")
        batch.drop_column("forward_bytes")
        batch.drop_column("forward_passes")
