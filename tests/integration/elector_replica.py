"""One replica for the elector fault tests, run as its own process.

    python elector_replica.py DSN LEASE_NAME TTL LABEL

It campaigns; while it leads it records its election and makes a fenced write
every 20 ms. It prints LEAD/CANCELLED/REJECTED lines, and on SIGTERM stops the
elector gracefully (resigning if it leads).
"""

from __future__ import annotations

import asyncio
import signal
import sys

import asyncpg

import pgcoord


async def main(dsn: str, name: str, ttl: float, label: str) -> None:
    # A paused process's open fenced transaction would hold up a takeover (the
    # row is FOR SHARE): the server ends such transactions after ttl/2.
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2, server_settings={
        "idle_in_transaction_session_timeout": str(int(ttl * 500)),
        "application_name": f"replica-{label}",
    })
    elector = pgcoord.Elector(dsn, name, ttl=ttl, holder=label)

    async def lead(fence: int) -> None:
        await pool.execute("insert into elections (replica, fence) values ($1, $2)", label, fence)
        print(f"LEAD {fence}", flush=True)
        try:
            while True:
                try:
                    async with pool.acquire() as conn, conn.transaction():
                        await pgcoord.check_fence(conn, name, fence)
                        await conn.execute(
                            "insert into fenced_writes (replica, fence) values ($1, $2)", label, fence)
                except pgcoord.StaleFence:
                    print(f"REJECTED {fence}", flush=True)
                except (OSError, asyncpg.PostgresError) as exc:
                    print(f"WRITE-ERROR {fence} {exc!r}", flush=True)
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            print(f"CANCELLED {fence}", flush=True)
            raise

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(elector.stop()))
    print("READY", flush=True)
    try:
        await elector.run(lead)
    finally:
        await pool.close()
        print("STOPPED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
