"""Semaphores and partitions: slot keys, and kind 'semaphore' in pgcoord.holders.

Revision ID: 0005
Revises: 0004
"""

from pgcoord.migrations import run_sql_file

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0005_semaphores.up.sql")


def downgrade() -> None:
    run_sql_file("0005_semaphores.down.sql")
