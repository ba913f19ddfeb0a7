"""A member's heartbeat in one statement that sweeps its group only when no older
member of it sweeps, and reads the group without pg_locks.

Revision ID: 0011
Revises: 0010
"""

from pgcoord.migrations import run_sql_file

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0011_member_beat.up.sql")


def downgrade() -> None:
    run_sql_file("0011_member_beat.down.sql")
