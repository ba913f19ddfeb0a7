"""Lease sessions judged on the server they lived on: pgcoord.leases.holder_server,
so that a failover or restart never lets a lease be taken over before it expires
while its holder may still believe.

Revision ID: 0007
Revises: 0006
"""

from pgcoord.migrations import run_sql_file

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    run_sql_file("0007_lease_server.up.sql")


def downgrade() -> None:
    run_sql_file("0007_lease_server.down.sql")
