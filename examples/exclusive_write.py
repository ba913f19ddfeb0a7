"""A service that does its nightly invoice run under exclusive(), atomically with its writes.

    python examples/exclusive_write.py postgresql://user@host/db

Run it from several terminals at once: one replica writes the run, the others find the
lock busy and skip, and the lock and the write commit together.
"""

import asyncio
import datetime as dt
import sys

import asyncpg

import pgcoord


async def main(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    await pool.execute("create table if not exists example_invoice_runs"
                       " (day date primary key, done_at timestamptz default now())")
    today = dt.date.today()
    try:
        async with pgcoord.exclusive(pool, "example:nightly-invoices", wait=False) as conn:
            # Same transaction as the lock: another replica cannot interleave.
            if await conn.fetchval("select 1 from example_invoice_runs where day = $1", today):
                print(f"invoices for {today} were already run")
            else:
                await conn.execute("insert into example_invoice_runs (day) values ($1)", today)
                print(f"ran invoices for {today}")
    except pgcoord.LockBusy:
        print("another replica is running the invoices right now; skipping")
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
