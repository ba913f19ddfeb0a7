"""LockHolder on a Member's session, and the connection budget of a member that
runs every feature at once."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

import pgcoord

from .conftest import advisory_locks, sql


def connections(dsn: str, prefix: str) -> int:
    rows = sql(dsn, "select count(*) from pg_stat_activity where application_name like %s", prefix + "%")
    return int(rows[0][0])  # type: ignore[call-overload]


async def test_locks_on_a_member_cost_no_connection_and_close_leaves_the_member_alone(dsn: str) -> None:
    app = f"hm-{uuid.uuid4().hex[:6]}"
    async with pgcoord.Member(dsn, group=app, application_name=app) as member:
        assert member._main is not None
        pid = member._main.backend_pid
        elector = pgcoord.Elector(member, f"{app}:lead", ttl=10)
        led = asyncio.Event()

        async def lead(fence: int) -> None:
            led.set()
            await asyncio.sleep(3600)

        running = asyncio.create_task(elector.run(lead))
        await asyncio.wait_for(led.wait(), 10)
        async with pgcoord.LockHolder(member) as holder:
            async with holder.lock("hm:a"), holder.lock("hm:b", shared=True):
                held = [k for p, k, g in advisory_locks(dsn) if p == pid]
                assert pgcoord.lock_key("hm:a") in held and pgcoord.lock_key("hm:b") in held
                assert connections(dsn, app) == 2
                # Operators see which member holds what.
                rows = sql(dsn, "select name, member from pgcoord.holders where kind = 'advisory'"
                                " and key = pgcoord.lock_key('hm:a')")
                assert rows == [(None, member.name)] or rows == [("hm:a", member.name)]
                rows = sql(dsn, "select member from pgcoord.holders where kind = 'lease' and name = %s",
                           f"{app}:lead")
                assert rows == [(member.name,)]
            await holder.flush()
        # The holder's locks are gone; the member's alive lock and the elector's
        # doorbell on the same session are not.
        async with asyncio.timeout(3):
            while {pgcoord.lock_key("hm:a"), pgcoord.lock_key("hm:b")} & {
                    k for p, k, g in advisory_locks(dsn) if p == pid}:
                await asyncio.sleep(0.02)
        assert elector.is_leader
        # (Besides the register of listeners, 0010: a lone member listens for the next.)
        assert sql(dsn, "select count(*) from pg_locks where pid = %s and objsubid = 2"
                        " and classid <> 1885823854::oid", pid) == [(1,)]
        await elector.stop()
        await running


async def test_a_lost_member_session_is_lock_lost_and_the_next_lock_uses_the_new_one(dsn: str) -> None:
    async with (
        pgcoord.Member(dsn, group=f"g-{uuid.uuid4().hex[:6]}", ttl=30) as member,
        pgcoord.LockHolder(member) as holder,
    ):
        assert member._main is not None
        old_pid = member._main.backend_pid
        with pytest.raises(pgcoord.LockLost):
            async with holder.lock("hm:lost"):
                sql(dsn, "select pg_terminate_backend(%s)", old_pid)
                await asyncio.sleep(5)
        await member.wait_joined()
        async with asyncio.timeout(5):
            while member._main is None or member._main.backend_pid == old_pid or member.id is None:
                await asyncio.sleep(0.02)
                await member.wait_joined()
        async with holder.lock("hm:lost"):
            assert holder.backend_pid == member._main.backend_pid != old_pid


async def test_a_process_with_one_member_and_every_feature_uses_two_connections_for_it(dsn: str) -> None:
    app = f"budget-{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6, server_settings={"application_name": "app-pool"})
    try:
        async with pgcoord.Member(dsn, group=app, application_name=app, ttl=10) as member:
            electors = [pgcoord.Elector(member, f"{app}:e{i}", ttl=10) for i in range(20)]
            elected: set[str] = set()

            def lead_for(name: str) -> object:
                async def lead(fence: int) -> None:
                    elected.add(name)
                    await asyncio.sleep(3600)
                return lead

            tasks = [asyncio.create_task(e.run(lead_for(e.name))) for e in electors]  # type: ignore[arg-type]
            sched = pgcoord.Scheduler(pool, member=member)
            for i in range(20):
                @sched.cron(f"{app}:job{i}", "* * * * * *")
                async def job(slot: pgcoord.Slot) -> None:
                    await asyncio.sleep(0.01)
            sched_task = asyncio.create_task(sched.run())
            leases = [pgcoord.Lease(pool, f"{app}:lease{i}", ttl=10, member=member) for i in range(10)]
            for lease in leases:
                await lease.acquire()
            async with pgcoord.LockHolder(member) as holder:
                from contextlib import AsyncExitStack

                async with AsyncExitStack() as stack:
                    for i in range(200):
                        await stack.enter_async_context(holder.lock(f"{app}:lock{i}"))
                    async with asyncio.timeout(10):
                        while len(elected) < 20:
                            await asyncio.sleep(0.05)
                    await asyncio.sleep(1.5)  # the scheduler ran slots meanwhile
                    assert connections(dsn, app) == 2
                    assert sql(dsn, "select count(*) from pgcoord.job_slots where job like %s"
                                    " and state = 'succeeded'", app + ":%") != [(0,)]
            for lease in leases:
                await lease.release()
            await sched.stop(drain=1)
            await sched_task
            for e in electors:
                await e.stop()
            for t in tasks:
                await t
    finally:
        await pool.close()
