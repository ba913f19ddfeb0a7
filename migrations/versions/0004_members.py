"""Members: pgcoord.member_sessions, the pgcoord.members view and their functions.

Revision ID: 0004
Revises: 0003
"""

from pgcoord.migrations import run_sql_file

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0004_members.up.sql")


def downgrade() -> None:
    run_sql_file("0004_members.down.sql")
