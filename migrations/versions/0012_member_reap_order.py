"""Every reaper marks the dead in id order (reapers in crossed orders deadlocked), and a
heartbeat is not undone by its sweep.

Revision ID: 0012
Revises: 0011
"""

from pgcoord.migrations import run_sql_file

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0012_member_reap_order.up.sql")


def downgrade() -> None:
    run_sql_file("0012_member_reap_order.down.sql")
