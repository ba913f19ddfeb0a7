"""A member's heartbeat and the scheduler's tick on its session (0011): a sessionless
member's death is told beside a long-ttl sweeper, and a tick held up or cancelled on
the member's session neither drops the member nor leaves the session unusable."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import pytest

import pgcoord

from .conftest import sql


def grp() -> str:
    return f"beat-{uuid.uuid4().hex[:6]}"


async def test_sessionless_short_ttl_death_told_despite_a_long_ttl_sweeper(dsn: str) -> None:
    # Group: A (lowest id, ttl 60 s), B and C (ttl 1.5 s), all sessionless (behind a
    # transaction-mode pooler). B stops beating. C beats every ttl/3 as a member does;
    # A beats every 20 s (its ttl/3), just once here. Before 0011 C's heartbeat swept
    # the group and told B's death within about B's ttl; now only A sweeps (it is
    # "fresh" for 30 s), so B stays listed for up to A's ttl/3.
    g = grp()
    conn = await asyncpg.connect(dsn)
    try:
        ids = {}
        for name, ttl_ms in (("A", 60000), ("B", 1500), ("C", 1500)):
            row = await conn.fetchrow("SELECT * FROM pgcoord.member_join($1, $2, NULL, $3, 'beat-test', false)",
                                      g, name, ttl_ms)
            ids[name] = row[0]
        assert ids["A"] < ids["B"] < ids["C"]
        await conn.fetchval("SELECT pgcoord.member_beat($1, false)", ids["A"])
        start = time.monotonic()
        while time.monotonic() - start < 3.5:  # > 2 x B's ttl
            await asyncio.sleep(0.5)  # C's cadence: ttl/3
            await conn.fetchval("SELECT pgcoord.member_beat($1, false)", ids["C"])
        left = await conn.fetchval(
            "SELECT left_at IS NOT NULL FROM pgcoord.member_sessions WHERE id = $1", ids["B"])
        listed = await conn.fetchval(
            'SELECT count(*) FROM pgcoord.members WHERE id = $1', ids["B"])
        assert listed == 0  # the view agrees it is dead ...
        assert left, "B's death (ttl 1.5 s) not told 3.5 s later: the sweeper is A (ttl 60 s)"
    finally:
        await conn.execute('DELETE FROM pgcoord.member_sessions WHERE "group" = $1', g)
        await conn.close()


async def test_a_tick_held_by_a_table_lock_does_not_drop_the_member(dsn: str) -> None:
    # schedule_tick on the member's session waits up to the session's lock_timeout
    # (500 ms) behind an operator's/migration's lock on pgcoord.schedule_owed; the
    # heartbeat queues behind it for at most ttl/2 (0.5 s at ttl=1) and the member
    # closes its session. Before, the tick ran on the pool and the member was untouched.
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    lost: list[int] = []
    try:
        async with pgcoord.Member(dsn, group=grp(), ttl=1.0) as member:
            member.on_session_lost(lost.append)
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(f"tick-job:{uuid.uuid4().hex[:6]}", "0 0 1 1 *")
            async def job() -> None:
                pass

            runner = asyncio.create_task(sched.run())
            try:
                await asyncio.sleep(2.0)
                locker = await asyncpg.connect(dsn)
                try:
                    tr = locker.transaction()
                    await tr.start()
                    await locker.execute("LOCK TABLE pgcoord.schedule_owed IN ACCESS EXCLUSIVE MODE")
                    await asyncio.sleep(4.0)
                    await tr.rollback()
                finally:
                    await locker.close()
                await asyncio.sleep(0.5)
                assert lost == [], f"member session dropped {len(lost)} time(s) by ticks behind a lock"
            finally:
                await sched.stop()
                await runner
    finally:
        await pool.close()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_cancelled_tick_on_the_member_session_leaves_it_usable(dsn: str, driver: str) -> None:
    # A Scheduler.stop()/cancel lands while schedule_tick runs on the member session
    # (here: waiting on a table lock so that it is surely mid-statement).
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    lost: list[int] = []
    try:
        async with pgcoord.Member(dsn, group=grp(), ttl=10.0, driver=driver) as member:
            member.on_session_lost(lost.append)
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(f"tick-job:{uuid.uuid4().hex[:6]}", "0 0 1 1 *")
            async def job() -> None:
                pass

            runner = asyncio.create_task(sched.run())
            await asyncio.sleep(2.0)
            locker = await asyncpg.connect(dsn)
            tr = locker.transaction()
            await tr.start()
            await locker.execute("LOCK TABLE pgcoord.schedule_owed IN ACCESS EXCLUSIVE MODE")
            await asyncio.sleep(1.1)  # a tick is now waiting on the lock
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            errors = []
            for _ in range(5):
                try:
                    await member._call("SELECT 1")
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))
            await tr.rollback()
            await locker.close()
            await asyncio.sleep(0.5)
            assert errors == [] and lost == [], (errors, lost)
    finally:
        await pool.close()
