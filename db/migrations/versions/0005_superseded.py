"""Candidates may be decided `superseded` (explore's rounds: a round-mate was accepted first).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies: a later change to db.models must not rewrite what this revision created.
BEFORE = "'drop', 'remeasure', 'gate', 'accept', 'retain', 'invalid', 'error', 'duplicate'"
AFTER = BEFORE + ", 'superseded'"
NAME = "ck_exploration_candidates_decision"


def _check(values: str) -> None:
    # SQLite cannot alter a CHECK in place: batch mode copies the table with the new one.
    with op.batch_alter_table("exploration_candidates") as batch:
        batch.drop_constraint(NAME, type_="check")
        batch.create_check_constraint(NAME, f"decision IS NULL OR decision IN ({values})")


def upgrade() -> None:
    _check(AFTER)


def downgrade() -> None:
    op.execute("UPDATE exploration_candidates SET decision = 'gate' WHERE decision = 'superseded'")
    _check(BEFORE)
