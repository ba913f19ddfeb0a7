"""Run-once cron: pgcoord.jobs, pgcoord.job_slots, their functions, job rows in the view.

Revision ID: 0003
Revises: 0002
"""

from pgcoord.migrations import run_sql_file

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0003_job_slots.up.sql")


def downgrade() -> None:
    run_sql_file("0003_job_slots.down.sql")
