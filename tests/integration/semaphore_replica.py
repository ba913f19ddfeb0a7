"""One process for the semaphore tests across processes.

    python semaphore_replica.py DSN NAME LIMIT SCOPE count TABLE TASKS
    python semaphore_replica.py DSN NAME LIMIT SCOPE hold

SCOPE is "xact" (``pgcoord.semaphore`` over an asyncpg pool) or "session"
(``holder.semaphore`` on a ``LockHolder``). ``count`` runs TASKS tasks that
each take a slot, add one to TABLE's ``cur`` (raising ``peak`` to it) on a
connection of its own, hold for 0.1 s, subtract one and let go; it prints
``DONE``. ``hold`` takes one slot, prints ``HOLDING`` and holds it until killed.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import asyncpg

import pgcoord


async def main(dsn: str, name: str, limit: int, scope: str, mode: str, *rest: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6)
    holder = pgcoord.LockHolder(dsn, max_wait_connections=32) if scope == "session" else None
    if holder is not None:
        await holder.open()

    def slot() -> Any:
        if holder is not None:
            return holder.semaphore(name, limit=limit, timeout=60)
        return pgcoord.semaphore(pool, name, limit=limit, timeout=60)

    if mode == "hold":
        async with slot():
            print("HOLDING", flush=True)
            await asyncio.Event().wait()
        return
    table, tasks = rest[0], int(rest[1])
    counter = await asyncpg.connect(dsn)
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
