"""psycopg connections hear their own death at once (issue 11, item 8).

psycopg reads from its socket only while a statement runs; pgcoord watches the
socket of an idle dedicated connection, so a LockHolder or an Elector over
psycopg learns that its session was terminated as soon as the server says so,
not at the next probe or renewal. Every test here uses a keepalive or ttl of
30 s, so a probe or a renewal cannot be what found out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg_pool
import pytest
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord
from pgcoord._drivers.dedicated import DsnSource

from .conftest import advisory_locks, sql
from .proxy import FreezableProxy
from .test_exclusive import Blocker, blocker  # noqa: F401 - fixture

HEARD_WITHIN = 1.0  # generous: the target is 10 ms at p99


@contextlib.asynccontextmanager
async def psycopg_source(kind: str, dsn: str) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    if kind == "dsn-psycopg":
        yield dsn, {"driver": "psycopg"}
    elif kind == "psycopg-pool":
        async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=2,
                                                    open=False) as pool:
            yield pool, {}
    else:
        engine = create_async_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
        try:
            yield engine, {}
        finally:
            await engine.dispose()


@pytest.mark.parametrize("kind", ["dsn-psycopg", "psycopg-pool", "sa-engine-psycopg"])
async def test_a_terminated_psycopg_holder_session_is_heard_at_once(kind: str, dsn: str) -> None:
    async with psycopg_source(kind, dsn) as (source, extra), \
            pgcoord.LockHolder(source, keepalive=30, **extra) as holder:
        for round_ in range(5):
            # Statements before the loss: the watch is taken down and put back
            # around each of them.
            for k in range(20):
                async with holder.lock(f"liveness:{k}", wait=False):
                    pass
            holding = asyncio.Event()
            cancelled_at = 0.0

            async def body(holding: asyncio.Event = holding) -> None:
                nonlocal cancelled_at
                async with holder.lock("liveness:held"):
                    holding.set()
                    try:
                        await asyncio.sleep(60)
                    except asyncio.CancelledError:
                        cancelled_at = time.monotonic()
                        raise

            task = asyncio.create_task(body())
            await asyncio.wait_for(holding.wait(), 10)
            await asyncio.sleep(0.05)  # idle: nothing in flight on the session
            pid = holder.backend_pid
            killed_at = time.monotonic()
            sql(dsn, "select pg_terminate_backend(%s)", pid)
            with pytest.raises(pgcoord.LockLost):
                await asyncio.wait_for(task, 10)
            assert cancelled_at - killed_at < HEARD_WITHIN, f"round {round_}"
    assert advisory_locks(dsn) == []


async def test_a_psycopg_elector_hears_its_session_die_at_once(dsn: str) -> None:
    name = f"liveness-elector:{uuid.uuid4().hex[:6]}"
    elector = pgcoord.Elector(dsn, name, ttl=30, driver="psycopg")
    leading, stepped_down = asyncio.Event(), asyncio.Event()
    lead_cancelled_at = 0.0

    async def lead(fence: int) -> None:
        nonlocal lead_cancelled_at
        leading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lead_cancelled_at = time.monotonic()
            stepped_down.set()
            raise

    run = asyncio.create_task(elector.run(lead))
    try:
        await asyncio.wait_for(leading.wait(), 10)
        assert elector.is_leader
        await asyncio.sleep(0.05)
        conn = elector._conn
        assert conn is not None
        killed_at = time.monotonic()
        sql(dsn, "select pg_terminate_backend(%s)", conn.backend_pid)
        await asyncio.wait_for(stepped_down.wait(), 5)
        assert not elector.is_leader
        assert lead_cancelled_at - killed_at < HEARD_WITHIN
    finally:
        await elector.stop()
        await asyncio.wait_for(run, 10)
        # The lease of the terminated session would show in pgcoord.holders
        # until its ttl ran out; other tests share the database.
        sql(dsn, "update pgcoord.leases set expires_at = now() where name = %s", name)


async def test_notifications_reach_an_idle_psycopg_connection(dsn: str) -> None:
    conn = await DsnSource(dsn, "psycopg", keepalive=30).open()
    try:
        lost = asyncio.Event()
        conn.on_lost(lost.set)  # starts the watch
        got: asyncio.Queue[str] = asyncio.Queue()
        conn.conn.add_notify_handler(lambda n: got.put_nowait(n.payload))
        await conn.execute('LISTEN "pgcoord_liveness"')
        for i in range(3):
            sql(dsn, "select pg_notify('pgcoord_liveness', %s)", str(i))
            # No statement runs on conn: only the watch can read it.
            assert await asyncio.wait_for(got.get(), HEARD_WITHIN) == str(i)
        assert not lost.is_set()
        assert await conn.fetchval("select 1") == 1  # psycopg's own reads are undisturbed
    finally:
        await conn.close_now()


async def test_a_given_back_connection_is_no_longer_watched(dsn: str) -> None:
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        async with pgcoord.LockHolder(pool, keepalive=30) as holder:
            pid = holder.backend_pid
        # The next borrower owns the socket: a notification is for psycopg to read
        # during its statements, not for the holder that gave the connection back.
        async with pool.connection() as conn:
            assert conn.info.backend_pid == pid
            await conn.set_autocommit(True)
            await conn.execute('LISTEN "pgcoord_given_back"')
            got: list[str] = []
            conn.add_notify_handler(lambda n: got.append(n.payload))
            sql(dsn, "select pg_notify('pgcoord_given_back', 'x')")
            await asyncio.sleep(0.3)
            assert got == []  # nobody read the socket behind psycopg's back
            await conn.execute("select 1")
            assert got == ["x"]
            await conn.execute("unlisten *")


async def test_cancelling_a_psycopg_wait_on_a_silent_network_never_blocks_the_event_loop(
    dsn: str, blocker: Blocker,  # noqa: F811
) -> None:
    # psycopg < 3.2 answers a cancellation with a cancel request sent by a
    # blocking call on the event loop: over a network that does not answer, the
    # loop would stop for good. pgcoord closes the connection instead.
    proxy = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]))
    gaps: list[float] = []

    async def heartbeat() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    try:
        blocker.hold("liveness:silent")
        async with pgcoord.LockHolder(proxy.dsn(dsn), driver="psycopg", keepalive=30) as holder:
            task = asyncio.create_task(_hold_forever(holder, "liveness:silent"))
            await _eventually(lambda: any(not g for _, _, g in advisory_locks(dsn)))
            proxy.freeze()
            await asyncio.sleep(0.2)
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 30)
            assert time.monotonic() - started < 20
            assert max(gaps) < 1.0, max(gaps)
            proxy.frozen.clear()
    finally:
        beat.cancel()
        proxy.close()
    blocker.release()
    await _eventually(lambda: advisory_locks(dsn) == [])


async def _hold_forever(holder: pgcoord.LockHolder, key: str) -> None:
    async with holder.lock(key):
        await asyncio.sleep(3600)


async def _eventually(check: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
