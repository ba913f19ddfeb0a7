"""The history of leadership (pgcoord.lease_terms, pgcoord.lease_history): the last
terms of each lease, who held them and how each ended, written by triggers on
pgcoord.leases.

Revision ID: 0009
Revises: 0008
"""

from pgcoord.migrations import run_sql_file

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0009_lease_terms.up.sql")


def downgrade() -> None:
    run_sql_file("0009_lease_terms.down.sql")
