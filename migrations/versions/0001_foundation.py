"""Foundation: lock_key(), lock_names and the holders view.

Revision ID: 0001
Revises:
"""

from pgcoord.migrations import run_sql_file

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0001_foundation.up.sql")


def downgrade() -> None:
    run_sql_file("0001_foundation.down.sql")
