"""A leader-elected duty whose writes are fenced.

    python examples/fenced_leader.py postgresql://user@host/db [seconds]

Start it in several terminals: one leads and writes; kill it (Ctrl-C, or kill -9) and
another takes over within milliseconds with a higher fence. A paused ex-leader's writes are
rejected by check_fence, because its fence is no longer current.
"""

import asyncio
import sys

import asyncpg

import pgcoord


async def main(dsn: str, seconds: float) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    await pool.execute("create table if not exists example_fenced_writes"
                       " (id serial primary key, fence bigint, at timestamptz default now())")
    elector = pgcoord.Elector(dsn, "example:scheduler", ttl=5.0)

    async def lead(fence: int) -> None:
        print(f"leading with fence {fence}")
        while True:
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, "example:scheduler", fence)  # StaleFence if superseded
                await conn.execute("insert into example_fenced_writes (fence) values ($1)", fence)
            await asyncio.sleep(0.5)

    runner = asyncio.create_task(elector.run(lead))
    await asyncio.sleep(seconds)
    print(f"current leader: {await elector.leader()}")
    await elector.stop()  # resigns: a follower would take over at once
    await runner
    written = await pool.fetchval("select count(*) from example_fenced_writes")
    print(f"{written} fenced writes so far; stopped")
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 3.0))
