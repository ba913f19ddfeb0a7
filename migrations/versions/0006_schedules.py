"""Schedules at runtime: pgcoord.schedules, its controls and the batched tick functions.

Revision ID: 0006
Revises: 0005
"""

from pgcoord.migrations import run_sql_file

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0006_schedules.up.sql")


def downgrade() -> None:
    run_sql_file("0006_schedules.down.sql")
