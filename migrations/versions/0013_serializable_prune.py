"""In a serializable transaction the leadership record prunes every 128th fence, not
every 8th: two prunes of different names that met on one index page failed a takeover
with 40001.

Revision ID: 0013
Revises: 0012
"""

from pgcoord.migrations import run_sql_file

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0013_serializable_prune.up.sql")


def downgrade() -> None:
    run_sql_file("0013_serializable_prune.down.sql")
