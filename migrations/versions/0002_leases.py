"""Leases with fencing tokens, check_fence(), lease rows in pgcoord.holders.

Revision ID: 0002
Revises: 0001
"""

from pgcoord.migrations import run_sql_file

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0002_leases.up.sql")


def downgrade() -> None:
    run_sql_file("0002_leases.down.sql")
