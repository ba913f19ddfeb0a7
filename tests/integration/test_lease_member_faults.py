"""Member leases off the happy path: a session that ends while acquire() waits, an
acquire cancelled after it rang the doorbell, a member that is rejoining, a graceful
handover, and a server that stops just before acquire() or Partitions.run().

Each of these was a reproduced defect of the lease written once per feature; they
hold now because every tenure (Lease, Elector, Partitions, job claims) goes through
one engine (docs/architecture.md, "The life of a lease")."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

import pgcoord
import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer

from .conftest import sql, unique


def bell_holders(dsn: str, name: str) -> list[int]:
    """The pids holding lease ``name``'s doorbell (a session lock)."""
    rows = sql(dsn, "select pid from pg_locks where locktype = 'advisory' and granted and objsubid = 1"
                    " and ((classid::bigint << 32) | objid::bigint) ="
                    " pgcoord.lock_key('pgcoord.elector:' || %s)", name)
    return [int(pid) for (pid,) in rows]  # type: ignore[call-overload]


async def until(predicate: Any, timeout: float, step: float = 0.01) -> None:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(step)


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


async def test_a_session_lost_while_acquire_waits_for_the_pool_never_gives_a_lease_anyone_may_take(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    name = unique("member-lease:lost-in-acquire")
    group = unique("g")
    async with (
        pgcoord.Member(dsn, group=group, name="a", ttl=30) as a,
        pgcoord.Member(dsn, group=group, name="b", ttl=30) as b,
    ):
        assert a._main is not None
        old_pid = a._main.backend_pid
        # Both pool connections are busy: acquire() rings its doorbell on the member's
        # session, then waits for a connection to take the row with.
        busy = [await pool.acquire(), await pool.acquire()]
        lease = pgcoord.Lease(pool, name, ttl=30, member=a)
        acquiring = asyncio.ensure_future(lease.acquire())
        await until(lambda: bell_holders(dsn, name) == [old_pid], 5)
        sql(dsn, "select pg_terminate_backend(%s)", old_pid)
        await asyncio.sleep(0.3)  # the member hears of it; acquire() still waits for the pool
        for conn in busy:
            await pool.release(conn)
        await asyncio.wait_for(acquiring, 15)
        try:
            assert lease.valid
            # Valid means nobody else can take it: tied to the member's live session.
            assert a._main is not None and a._main.backend_pid != old_pid
            assert sql(dsn, "select holder_pid from pgcoord.leases where name = %s", name) == [
                (a._main.backend_pid,)]
            with pytest.raises(pgcoord.LockBusy):
                await pgcoord.Lease(pool, name, ttl=30, member=b).acquire(wait=False)
        finally:
            await lease.release()


async def test_an_acquire_cancelled_after_ringing_the_doorbell_lets_go_of_it(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    name = unique("member-lease:cancelled")
    group = unique("g")
    async with (
        pgcoord.Member(dsn, group=group, name="a", ttl=30) as a,
        pgcoord.Member(dsn, group=group, name="b", ttl=30) as b,
    ):
        assert a._main is not None
        busy = [await pool.acquire(), await pool.acquire()]
        acquiring = asyncio.ensure_future(pgcoord.Lease(pool, name, ttl=30, member=a).acquire())
        await until(lambda: bell_holders(dsn, name) == [a._main.backend_pid], 5)  # type: ignore[union-attr]
        acquiring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await acquiring
        for conn in busy:
            await pool.release(conn)
        await until(lambda: bell_holders(dsn, name) == [], 3)
        # b gets a lease tied to its own session, at once.
        other = pgcoord.Lease(pool, name, ttl=30, member=b)
        started = time.monotonic()
        await other.acquire(timeout=5)
        try:
            assert time.monotonic() - started < 2.0
            assert b._main is not None
            assert sql(dsn, "select holder_pid from pgcoord.leases where name = %s", name) == [
                (b._main.backend_pid,)]
        finally:
            await other.release()


async def test_a_graceful_release_wakes_the_waiting_member_at_once(dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("member-lease:handover")
    group = unique("g")
    ttl = 9.0  # a quiet wait is ttl/3 = 3 s: a handover that needs one shows
    handovers: list[float] = []
    async with (
        pgcoord.Member(dsn, group=group, name="a", ttl=30) as a,
        pgcoord.Member(dsn, group=group, name="b", ttl=30) as b,
    ):
        holder, waiter = a, b
        lease = pgcoord.Lease(pool, name, ttl=ttl, member=holder)
        await lease.acquire()
        for _ in range(3):
            nxt = pgcoord.Lease(pool, name, ttl=ttl, member=waiter)
            waiting = asyncio.ensure_future(nxt.acquire())
            await asyncio.sleep(0.3)
            assert not waiting.done()
            released = time.monotonic()
            await lease.release()
            await asyncio.wait_for(waiting, 10)
            handovers.append(time.monotonic() - released)
            lease, holder, waiter = nxt, waiter, holder
        await lease.release()
    assert max(handovers) < 1.0, handovers


# -- a member without a session: wait= and timeout= hold, errors are pgcoord's -------------------

@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer({"synchronous_commit": "on"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


async def test_wait_and_timeout_hold_while_the_member_is_rejoining(own_server: EmbeddedServer) -> None:
    dsn = own_server.dsn
    name = unique("member-lease:rejoining")
    pool = await asyncpg.create_pool(dsn, min_size=0, max_size=2)
    try:
        async with pgcoord.Member(dsn, group=unique("g"), ttl=30) as m:
            own_server._shutdown(signal.SIGQUIT)
            try:
                await until(lambda: not m.has_session, 5)
                started = time.monotonic()
                with pytest.raises(pgcoord.LockBusy):
                    await pgcoord.Lease(pool, name, ttl=30, member=m).acquire(wait=False)
                assert time.monotonic() - started < 1.0
                started = time.monotonic()
                with pytest.raises(pgcoord.LockTimeout):
                    await pgcoord.Lease(pool, name, ttl=30, member=m).acquire(timeout=1)
                assert time.monotonic() - started < 2.5
            finally:
                await asyncio.to_thread(own_server._spawn)
            lease = pgcoord.Lease(pool, name, ttl=30, member=m)
            await lease.acquire(timeout=20)
            assert lease.valid
            await lease.release()
    finally:
        await pool.close()


async def test_a_server_stopped_just_before_acquire_gives_a_pgcoord_error(own_server: EmbeddedServer) -> None:
    dsn = own_server.dsn
    name = unique("member-lease:stopped")
    pool = await asyncpg.create_pool(dsn, min_size=0, max_size=2)
    try:
        async with pgcoord.Member(dsn, group=unique("g"), ttl=30) as m:
            own_server._shutdown(signal.SIGQUIT)  # the loop has not heard of it yet
            try:
                with pytest.raises(pgcoord.PgcoordError):
                    await pgcoord.Lease(pool, name, ttl=30, member=m).acquire(timeout=2)
            finally:
                await asyncio.to_thread(own_server._spawn)
    finally:
        await pool.close()


async def test_partitions_run_started_as_the_server_stops_goes_on_and_leaves_nothing_registered(
    own_server: EmbeddedServer,
) -> None:
    dsn = own_server.dsn
    name = f"parts-stopped-{uuid.uuid4().hex[:6]}"
    async with pgcoord.Member(dsn, group=unique("g"), ttl=30) as m:
        channels_before = m._channels.registered()
        parts = pgcoord.Partitions(m, name, count=4)
        owned: set[int] = set()

        async def own(part: pgcoord.Partition) -> None:
            owned.add(part.index)
            await asyncio.Event().wait()

        own_server._shutdown(signal.SIGQUIT)
        running = asyncio.ensure_future(parts.run(own))
        try:
            await asyncio.sleep(2.0)
            assert not running.done(), running.exception() if running.done() else None
        finally:
            await asyncio.to_thread(own_server._spawn)
        await until(lambda: parts.owned == frozenset(range(4)), 20, step=0.05)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert {ch: n for ch, n in m._channels.registered().items() if n or ch in channels_before} == {
            ch: n for ch, n in channels_before.items()}


# -- found by trying to break the above (two features of one member; fenced rows) -----------

async def test_a_cancelled_ring_never_unlocks_the_doorbell_another_lease_of_the_member_holds(
    dsn: str,
) -> None:
    # Session locks are re-entrant: a second Lease of the same member rings the same
    # bell on the same session. Cancelled while its try waits its turn on the session,
    # it must not unlock the level the first lease holds.
    name = unique("member-lease:same-member")
    group = unique("g")
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    try:
        async with (
            pgcoord.Member(dsn, group=group, name="m1", ttl=30) as m1,
            pgcoord.Member(dsn, group=group, name="m2", ttl=30) as m2,
        ):
            held = pgcoord.Lease(pool, name, ttl=30, member=m1)
            await held.acquire()
            stop = False

            async def keep_busy() -> None:  # m1's shared session, busy through its public API
                while not stop:
                    await m1.peers()

            busy = [asyncio.ensure_future(keep_busy()) for _ in range(2)]
            try:
                other = pgcoord.Lease(pool, name, ttl=30, member=m1)
                for i in range(150):
                    with contextlib.suppress(TimeoutError, pgcoord.LockBusy):
                        await asyncio.wait_for(other.acquire(wait=False), timeout=0.0005 * (i % 7))
                    if other.fence is not None:
                        await other.release()
                    await asyncio.sleep(0.003)
                    assert m1._main is not None
                    assert m1._main.backend_pid in bell_holders(dsn, name), f"bell lost at try {i}"
            finally:
                stop = True
                await asyncio.gather(*busy)
            await asyncio.sleep(0.3)  # any unlock sent in the background has run by now
            assert held.valid
            with pytest.raises(pgcoord.LockBusy):
                await pgcoord.Lease(pool, name, ttl=30, member=m2).acquire(wait=False)
            await held.release()
    finally:
        await pool.close()


@pytest.mark.parametrize("with_member", [True, False], ids=["member", "plain"])
async def test_wait_false_on_a_row_a_fenced_transaction_holds_is_busy_at_once(
    dsn: str, with_member: bool,
) -> None:
    name = unique("lease:fenced-busy")
    group = unique("g")
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    try:
        async with (
            pgcoord.Member(dsn, group=group, ttl=30) as m1,
            pgcoord.Member(dsn, group=group, ttl=30) as m2,
        ):
            held = pgcoord.Lease(pool, name, ttl=30, member=m1 if with_member else None)
            fence = await held.acquire()
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, name, fence)  # the row FOR SHARE until commit
                contender = pgcoord.Lease(pool, name, ttl=30, member=m2 if with_member else None)
                started = time.monotonic()
                with pytest.raises(pgcoord.LockBusy):
                    await contender.acquire(wait=False)
                assert time.monotonic() - started < 1.0
                started = time.monotonic()
                with pytest.raises(pgcoord.LockTimeout):
                    await contender.acquire(timeout=0.5)
                assert time.monotonic() - started < 1.5
            await held.release()
    finally:
        await pool.close()
