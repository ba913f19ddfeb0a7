"""A Lease tied to a Member: taken over at once when the member's session ends,
never while it lives."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import asyncpg
import pytest

import pgcoord

from .conftest import doorbell_waiters, ring_then_take, sql


async def test_a_dead_member_s_lease_is_taken_over_without_waiting_out_its_ttl(dsn: str) -> None:
    name = f"member-lease:{uuid.uuid4().hex[:6]}"
    group = f"g-{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        async with (
            pgcoord.Member(dsn, group=group, name="holder", ttl=30) as a,
            pgcoord.Member(dsn, group=group, name="taker", ttl=30) as b,
        ):
            held = pgcoord.Lease(pool, name, ttl=30, member=a)
            fence = await held.acquire()
            # Alive: nobody else may take it.
            with pytest.raises(pgcoord.LockBusy):
                await pgcoord.Lease(pool, name, ttl=30, member=b).acquire(wait=False)
            taker = pgcoord.Lease(pool, name, ttl=30, member=b)
            waiting = asyncio.ensure_future(taker.acquire())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            assert a._main is not None
            killed = time.monotonic()
            sql(dsn, "select pg_terminate_backend(%s)", a._main.backend_pid)
            # ttl is 30 s: only the member's death can make this quick.
            new_fence = await asyncio.wait_for(waiting, 5)
            assert new_fence == fence + 1
            assert time.monotonic() - killed < 3.0
            # The old holder stopped believing at once (its own process hears of
            # its session's end in the same milliseconds as the taker).
            async with asyncio.timeout(1):
                while held.valid:
                    await asyncio.sleep(0.005)
            with pytest.raises(pgcoord.LeaseLost):
                held.ensure()
            await held.release()
            await taker.release()
            assert sql(dsn, "select holder from pgcoord.leases where name = %s", name) == [(None,)]
    finally:
        await pool.close()


async def test_a_body_under_a_member_lease_is_cancelled_when_the_member_session_ends(dsn: str) -> None:
    name = f"member-lease-body:{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        async with pgcoord.Member(dsn, group=f"g-{uuid.uuid4().hex[:6]}", ttl=30) as m:
            started = asyncio.Event()

            async def body() -> None:
                async with pgcoord.Lease(pool, name, ttl=30, member=m):
                    started.set()
                    await asyncio.sleep(60)

            task = asyncio.ensure_future(body())
            await asyncio.wait_for(started.wait(), 5)
            assert m._main is not None
            sql(dsn, "select pg_terminate_backend(%s)", m._main.backend_pid)
            with pytest.raises(pgcoord.LeaseLost):
                await asyncio.wait_for(task, 5)
    finally:
        await pool.close()


async def test_a_member_lease_releases_its_doorbell_with_the_lease(dsn: str) -> None:
    name = f"member-lease-bell:{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        async with pgcoord.Member(dsn, group=f"g-{uuid.uuid4().hex[:6]}", ttl=30) as m:
            assert m._main is not None
            pid = m._main.backend_pid
            bell = sql(dsn, "select pgcoord.lock_key('pgcoord.elector:' || %s)", name)[0][0]
            async with pgcoord.Lease(pool, name, ttl=30, member=m):
                assert sql(dsn, "select count(*) from pg_locks where locktype = 'advisory' and pid = %s"
                                " and ((classid::bigint << 32) | objid::bigint) = %s", pid, bell) == [(1,)]
            async with asyncio.timeout(3):
                while sql(dsn, "select count(*) from pg_locks where locktype = 'advisory' and pid = %s"
                               " and objsubid = 1", pid) != [(0,)]:
                    await asyncio.sleep(0.02)
    finally:
        await pool.close()


async def test_a_release_is_recorded_though_the_doorbell_is_taken_at_once(dsn: str) -> None:
    """A release lets go of the row before the doorbell: else a contender waiting on
    the bell takes the row over from under it, the release matches nothing, and the
    term is recorded as taken over (no release told to anyone)."""
    name = f"lease-bell-order:{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        async with pgcoord.Member(dsn, group=f"g-{uuid.uuid4().hex[:6]}", ttl=30) as m:
            held = pgcoord.Lease(pool, name, ttl=30, member=m)
            fence = await held.acquire()
            taken: list[object] = []
            contender = threading.Thread(target=ring_then_take, args=(dsn, name, taken), daemon=True)
            contender.start()
            async with asyncio.timeout(5):
                while doorbell_waiters(dsn, name) != 1:
                    await asyncio.sleep(0.01)
            row = held._row

            async def slowly(statement: str, *params: object, via: object = None) -> object:
                if statement == "lease_release_bounded":
                    await asyncio.sleep(0.2)  # a loaded machine: the release comes late
                return await row(statement, *params, via=via)  # type: ignore[arg-type]

            held._row = slowly  # type: ignore[method-assign]
            await held.release()
            await asyncio.to_thread(contender.join, 5)
            assert taken == [fence + 1]
            assert sql(dsn, "select ended_how from pgcoord.lease_terms where name = %s and fence = %s",
                       name, fence) == [("released",)]
    finally:
        await pool.close()
