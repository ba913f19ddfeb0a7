"""Members are marked gone by one reaper at a time: reapers in crossed orders deadlocked.

Revision ID: 0012
Revises: 0011
"""

from pgcoord.migrations import run_sql_file

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0012_member_reap_turns.up.sql")


def downgrade() -> None:
    run_sql_file("0012_member_reap_turns.down.sql")
