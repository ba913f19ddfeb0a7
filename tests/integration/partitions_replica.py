"""One process running Partitions, for the fault tests and bench/partitions.py.

    python partitions_replica.py DSN NAME COUNT MEMBER TTL DRIVER [WRITE_TABLE]

Prints ``JOINED <member id>``, then ``OWN <index> <fence> <unix time>`` when an
own() starts and ``END <index> <fence> <unix time>`` when it ends, and ``LEFT <member> <unix
time>`` when it hears a member is gone. With
WRITE_TABLE, each own() does a fenced write (check_fence, then an insert of
(part, fence, writer)) every 20 ms and prints ``STALE <index> <fence>`` for each
write the fence rejected. On SIGTERM it leaves gracefully.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import asyncpg

import pgcoord


async def main(dsn: str, name: str, count: int, member_name: str, ttl: float, driver: str,
               table: str | None) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    pool = None
    if table:
        # A paused process's open fenced transaction would hold its part's row FOR
        # SHARE, and so hold up the takeover, for as long as the pause: the server
        # ends such a transaction after a second (docs/partitions.md). asyncpg: with the
        # oldest psycopg allowed (3.2.3, psycopg-pool 3.2.0) an own() cancelled inside
        # pool.connection() / conn.transaction() was seen never to finish (the pool
        # logging "Explicit rollback() forbidden within a Transaction context"), and
        # own() is awaited however long it takes.
        pool = await asyncpg.create_pool(
            dsn, min_size=2, max_size=4, server_settings={"idle_in_transaction_session_timeout": "1000"})

    async def own(part: pgcoord.Partition) -> None:
        print(f"OWN {part.index} {part.fence} {time.time():.6f}", flush=True)
        try:
            while True:
                if pool is not None:
                    try:
                        async with pool.acquire() as conn, conn.transaction():
                            await pgcoord.check_fence(conn, part.name, part.fence)
                            await conn.execute(f"insert into {table} (part, fence, writer) values ($1, $2, $3)",
                                               part.index, part.fence, member_name)
                    except pgcoord.StaleFence:
                        print(f"STALE {part.index} {part.fence}", flush=True)
                await asyncio.sleep(0.02)
        finally:
            print(f"END {part.index} {part.fence} {time.time():.6f}", flush=True)

    async with pgcoord.Member(dsn, group=f"g-{name}", name=member_name, ttl=ttl, driver=driver) as member:
        print(f"JOINED {member.id}", flush=True)
        changes = member.watch()

        async def report() -> None:
            async for change in changes:
                if isinstance(change, pgcoord.MemberLeft):
                    print(f"LEFT {change.member.name} {time.time():.6f}", flush=True)

        reporter = asyncio.create_task(report())
        parts = pgcoord.Partitions(member, name, count=count)
        runner = asyncio.create_task(parts.run(own))
        await stop.wait()
        runner.cancel()
        try:
            await runner
        except asyncio.CancelledError:
            pass
        reporter.cancel()
    if pool is not None:
        await pool.close()
    print("STOPPED", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], args[1], int(args[2]), args[3], float(args[4]), args[5],
                     args[6] if len(args) > 6 else None))
