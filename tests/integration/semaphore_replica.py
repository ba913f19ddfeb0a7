"""One process for the semaphore tests across processes.

    python semaphore_replica.py DSN NAME LIMIT SCOPE count TABLE TASKS
    python semaphore_replica.py DSN NAME LIMIT SCOPE hold

SCOPE is "xact" (``pgcoord.semaphore`` over an asyncpg pool), "joined" (the
same inside a transaction of the caller's own), "pooler" (over a psycopg pool
whose DSN is a transaction-mode PgBouncer's) or "session" (``holder.semaphore``
on a ``LockHolder``). ``count`` runs TASKS tasks that
each take a slot, add one to TABLE's ``cur`` (raising ``peak`` to it) on a
connection of its own, hold for 0.1 s, subtract one and let go; it prints
``DONE``. ``hold`` takes one slot, prints ``HOLDING`` and holds it until killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

import asyncpg

import pgcoord


async def main(dsn: str, name: str, limit: int, scope: str, mode: str, *rest: str) -> None:
    # Through a pooler no statement may be prepared (asyncpg's cache is off).
    pool: Any = await asyncpg.create_pool(dsn, min_size=1, max_size=6, statement_cache_size=0)
    if scope == "pooler":
        import psycopg_pool

        await pool.close()
        pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=6, open=False,
                                                kwargs={"prepare_threshold": None})
        await pool.open()
    holder = pgcoord.LockHolder(dsn, max_wait_connections=32) if scope == "session" else None
    if holder is not None:
        await holder.open()

    @contextlib.asynccontextmanager
    async def slot() -> Any:
        if holder is not None:
            async with holder.semaphore(name, limit=limit, timeout=60):
                yield
        elif scope == "joined":
            async with pool.acquire() as conn, conn.transaction(), \
                    pgcoord.semaphore(conn, name, limit=limit, timeout=60):
                yield
        else:
            async with pgcoord.semaphore(pool, name, limit=limit, timeout=60):
                yield

    if mode == "hold":
        async with slot():
            print("HOLDING", flush=True)
            await asyncio.Event().wait()
        return
    table, tasks = rest[0], int(rest[1])
    counter = await asyncpg.connect(dsn, statement_cache_size=0)
    counting = asyncio.Lock()  # one statement at a time on the counter connection

    async def task() -> None:
        async with slot():
            async with counting:
                await counter.execute(
                    f"update {table} set cur = cur + 1, peak = greatest(peak, cur + 1)")
            await asyncio.sleep(0.1)
            async with counting:
                await counter.execute(f"update {table} set cur = cur - 1")

    await asyncio.gather(*(task() for _ in range(tasks)))
    print("DONE", flush=True)
    await counter.close()
    if holder is not None:
        await holder.close()
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5],
                     *sys.argv[6:]))
