"""pgcoord in a codebase without asyncio: psycopg and SQLAlchemy, synchronous.

    python examples/sync_usage.py postgresql://user@host/db
"""

import sys

import psycopg_pool
from sqlalchemy import create_engine, text

import pgcoord


def main(dsn: str) -> None:
    with psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        with pgcoord.exclusive(pool, "example:sync-report") as conn:
            conn.execute("create table if not exists example_sync (n int)")
            conn.execute("insert into example_sync values (1)")  # commits with the lock
        print("psycopg: wrote under the lock")
        try:
            with pgcoord.exclusive(pool, "example:sync-report", timeout=0.5):
                pass
        except pgcoord.LockTimeout:
            print("someone else held it for half a second")

    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    with pgcoord.exclusive(engine, "example:sync-report", wait=False) as conn:
        count = conn.execute(text("select count(*) from example_sync")).scalar_one()
        print(f"SQLAlchemy: {count} rows, read under the lock")
    with engine.connect() as conn:
        try:
            pgcoord.check_fence(conn, "example:no-such-lease", 1)
        except pgcoord.StaleFence as stale:
            print(f"check_fence refused a fence nobody issued: {stale}")
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1])
