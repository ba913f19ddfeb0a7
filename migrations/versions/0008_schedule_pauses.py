"""Every pause of a schedule (pgcoord.schedule_pauses), a changed expression in code
counted from the change, and runs owed that obey the schedule's overlap rule.

Revision ID: 0008
Revises: 0007
"""

from pgcoord.migrations import run_sql_file

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0008_schedule_pauses.up.sql")


def downgrade() -> None:
    run_sql_file("0008_schedule_pauses.down.sql")
