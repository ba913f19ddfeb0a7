"""Every function of schema pgcoord pins its search_path, and pgcoord's own NOTIFYs
are sent only when some session listens for them (a register of listeners).

Revision ID: 0010
Revises: 0009 (re-chained onto 0009 at merge)
"""

from pgcoord.migrations import run_sql_file

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0010_search_path.up.sql")


def downgrade() -> None:
    run_sql_file("0010_search_path.down.sql")
