"""Leases under hostile conditions (issue 11): hung cleanups, misuse of check_fence,
stale pooled connections, small pools, bare connections, and a server that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord
import pgcoord.migrations
from pgcoord.leases import lease as leases
from pgcoord.leases import statements
from pgcoord._core.embedded import EmbeddedServer

from .conftest import sql, unique
from .sources import APP, ASYNC_POOLS, open_async


async def until(predicate: Any, timeout: float, step: float = 0.01) -> float:  # noqa: ASYNC109
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - started


def lock_waiters(dsn: str) -> int:
    """Sessions of this database waiting on a lock (a row lock, here)."""
    [(n,)] = sql(dsn, "select count(*) from pg_stat_activity where wait_event_type = 'Lock'"
                      " and datname = current_database()")
    return int(n)  # type: ignore[call-overload]


def hold_for_share(dsn: str, name: str, fence: int) -> psycopg.Connection[Any]:
    """Another session's fenced transaction, left open: the lease row stays FOR SHARE."""
    blocker = psycopg.connect(dsn)
    pgcoord.check_fence(blocker, name, fence)
    return blocker


@pytest.fixture
def short_release(monkeypatch: pytest.MonkeyPatch) -> float:
    bound = 0.5
    monkeypatch.setattr(leases, "RELEASE_TIMEOUT", bound, raising=False)
    monkeypatch.setattr(leases, "CLEANUP_TIMEOUT", bound, raising=False)
    return bound


# -- 1. a hung release gives up at its bound --------------------------------------------------

@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_leaving_a_lease_whose_release_hangs_returns_at_the_bound(
    kind: str, dsn: str, short_release: float, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 11 item 3: another session holds the row FOR SHARE, so the release waits.
    The exit gives up after its bound, without a CancelledError nobody asked for, and
    the server stops waiting too."""
    caplog.set_level("WARNING", logger="pgcoord.leases")
    name = unique("lease:hung-release")
    blocker = None
    try:
        async with open_async(kind, dsn) as source:
            async with pgcoord.Lease(source, name, ttl=30) as fence:
                blocker = hold_for_share(dsn, name, fence)
                started = time.monotonic()
            took = time.monotonic() - started
            assert took < short_release + 1.5, took
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
            assert "expire" in caplog.text  # says what becomes of the lease
            # Nobody on the server still waits on the row for us.
            await until(lambda: lock_waiters(dsn) == 0, 3)
            # The pool is still usable afterwards.
            async with pgcoord.Lease(source, unique("lease:after"), ttl=5):
                pass
    finally:
        if blocker is not None:
            blocker.close()
    # Still ours in the database until it expires on its own.
    assert sql(dsn, "select holder is not null from pgcoord.leases where name = %s", name) == [(True,)]


async def test_a_hung_release_still_gives_the_body_its_own_exception(
    dsn: str, short_release: float,
) -> None:
    name = unique("lease:hung-release-error")
    blocker = None
    try:
        async with open_async("asyncpg-pool", dsn) as source:
            started = 0.0
            with pytest.raises(KeyError, match="the body's own"):
                async with pgcoord.Lease(source, name, ttl=30) as fence:
                    blocker = hold_for_share(dsn, name, fence)
                    started = time.monotonic()
                    raise KeyError("the body's own")
            assert time.monotonic() - started < short_release + 1.5
    finally:
        if blocker is not None:
            blocker.close()


async def test_a_cancelled_caller_whose_release_hangs_gets_its_own_cancellation(
    dsn: str, short_release: float,
) -> None:
    name = unique("lease:hung-release-cancel")
    holding = asyncio.Event()
    blocker = None

    async def body() -> None:
        nonlocal blocker
        async with open_async("psycopg-pool", dsn) as source, \
                pgcoord.Lease(source, name, ttl=30) as fence:
            blocker = hold_for_share(dsn, name, fence)
            holding.set()
            await asyncio.sleep(3600)

    try:
        task = asyncio.create_task(body())
        await holding.wait()
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < short_release + 3
    finally:
        if blocker is not None:
            blocker.close()


# -- 2. check_fence outside a transaction fences nothing: it raises ----------------------------

@pytest.fixture
def issued(dsn: str) -> tuple[str, int]:
    name = unique("lease:misuse")
    [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'writer', 60000, null)", name)
    return name, fence


def _sa(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


def _not_a_fence(exc: BaseException) -> None:
    assert isinstance(exc, pgcoord.PgcoordError) and not isinstance(exc, pgcoord.StaleFence)
    assert "transaction" in str(exc)


async def test_check_fence_outside_a_transaction_raises_on_every_async_connection(
    dsn: str, issued: tuple[str, int],
) -> None:
    name, fence = issued
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(pgcoord.PgcoordError) as info:
            await pgcoord.check_fence(conn, name, fence)
        _not_a_fence(info.value)
        async with conn.transaction():  # the connection is fine, and inside one it works
            await pgcoord.check_fence(conn, name, fence)
    finally:
        await conn.close()

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        async with pool.acquire() as pooled:
            with pytest.raises(pgcoord.PgcoordError) as info:
                await pgcoord.check_fence(pooled, name, fence)
            _not_a_fence(info.value)
    finally:
        await pool.close()

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as pconn:
        with pytest.raises(pgcoord.PgcoordError) as info:
            await pgcoord.check_fence(pconn, name, fence)
        _not_a_fence(info.value)
        async with pconn.transaction():
            await pgcoord.check_fence(pconn, name, fence)
    # Without autocommit psycopg opens the transaction itself: the check is its first
    # statement and fences the writes that follow until commit.
    async with await psycopg.AsyncConnection.connect(dsn) as pconn:
        await pgcoord.check_fence(pconn, name, fence)
        await pconn.rollback()

    for driver in ("asyncpg", "psycopg"):
        engine = create_async_engine(_sa(dsn, driver), isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as saconn:
                with pytest.raises(pgcoord.PgcoordError) as info:
                    await pgcoord.check_fence(saconn, name, fence)
                _not_a_fence(info.value)
        finally:
            await engine.dispose()


def test_check_fence_outside_a_transaction_raises_on_every_sync_connection(
    dsn: str, issued: tuple[str, int],
) -> None:
    name, fence = issued
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(pgcoord.PgcoordError) as info:
            pgcoord.check_fence(conn, name, fence)
        _not_a_fence(info.value)
        with conn.transaction():
            pgcoord.check_fence(conn, name, fence)
    engine = create_engine(_sa(dsn, "psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as saconn:
            with pytest.raises(pgcoord.PgcoordError) as info:
                pgcoord.check_fence(saconn, name, fence)
            _not_a_fence(info.value)
    finally:
        engine.dispose()


async def test_a_stale_fence_outside_a_transaction_is_still_reported_as_misuse(
    dsn: str, issued: tuple[str, int],
) -> None:
    """Whether or not the fence is current, the caller learns the check fenced nothing."""
    name, fence = issued
    conn = await asyncpg.connect(dsn)
    try:
        with pytest.raises(pgcoord.PgcoordError) as info:
            await pgcoord.check_fence(conn, name, fence + 1)
        _not_a_fence(info.value)
        assert isinstance(info.value.__cause__, pgcoord.StaleFence)
    finally:
        await conn.close()


# -- 3. a stale pooled connection is not the caller's problem ----------------------------------

def terminate_idle(dsn: str) -> int:
    """End every idle session the test pools opened (they sit idle in their pools)."""
    rows = sql(dsn, "select pg_terminate_backend(pid) from pg_stat_activity"
                    " where application_name = %s and datname = current_database()"
                    " and state = 'idle' and pid <> pg_backend_pid()", APP)
    return len(rows)


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_acquire_and_release_survive_terminated_idle_pool_connections(
    kind: str, dsn: str,
) -> None:
    """Issue 11 item 10: pg_terminate_backend of idle pooled connections used to leak
    asyncpg's InternalClientError from acquire, and then the release failed too."""
    name = unique("lease:stale-pool")
    async with open_async(kind, dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=5)
        fences = []
        terminated = 0
        for i in range(12):
            terminated += terminate_idle(dsn)
            # Let the client hear of it, or not, at different moments.
            if i % 3 == 1:
                await asyncio.sleep(0.001 * i)
            elif i % 3 == 2:
                time.sleep(0.001 * i)  # noqa: ASYNC251 - the loop must not run meanwhile
            # (Bounded: a pool that lost its connections on the way would wait forever.)
            fences.append(await asyncio.wait_for(lease.acquire(wait=False), 10))
            terminated += terminate_idle(dsn)
            if i % 2:
                await asyncio.sleep(0.002 * i)
            await asyncio.wait_for(lease.release(), 10)
            assert sql(dsn, "select holder from pgcoord.leases where name = %s", name) == [(None,)]
        assert fences == list(range(fences[0], fences[0] + 12))
        assert terminated >= 6  # the pool really was handing out terminated connections
        # No connection was lost to the pool on the way: all four can be had at once.
        held = await asyncio.wait_for(asyncio.gather(*(_borrow(kind, source) for _ in range(4))), 10)
        for _, give_back in held:
            await give_back()


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_renewals_survive_terminated_pool_connections_without_losing_the_lease(
    kind: str, dsn: str,
) -> None:
    name = unique("lease:stale-renew")
    async with open_async(kind, dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=0.9)
        async with lease as fence:
            for _ in range(8):
                terminate_idle(dsn)
                await asyncio.sleep(0.15)
                assert lease.valid
        assert lease.fence is None
        assert sql(dsn, "select holder, fence from pgcoord.leases where name = %s", name) == [
            (None, fence)]


# -- 4. bare connections and small pools are refused at once -----------------------------------

@pytest.mark.parametrize("kind", ["asyncpg-conn", "asyncpg-pooled-conn", "psycopg-conn", "sa-async-conn"])
async def test_a_lease_refuses_a_bare_connection(kind: str, dsn: str) -> None:
    """Issue 11 item 12: renewals would run beside, or inside, the owner's own transactions."""
    async with open_async(kind, dsn) as conn:
        with pytest.raises(pgcoord.UnsupportedConnection, match="pool"):
            pgcoord.Lease(conn, unique("lease:bare"), ttl=5)


async def test_a_lease_refuses_a_pool_of_one_connection(dsn: str) -> None:
    """The body may hold the pool's only connection while a renewal needs one: rather
    than lose the lease a trust window later, refuse at once and say why."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        with pytest.raises(pgcoord.PgcoordError, match="max_size"):
            pgcoord.Lease(pool, "x", ttl=5)
    finally:
        await pool.close()
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as ppool:
        with pytest.raises(pgcoord.PgcoordError, match="max_size"):
            pgcoord.Lease(ppool, "x", ttl=5)
    engine = create_async_engine(_sa(dsn, "asyncpg"), pool_size=1, max_overflow=0)
    try:
        with pytest.raises(pgcoord.PgcoordError, match=r"max_size|pool_size"):
            pgcoord.Lease(engine, "x", ttl=5)
    finally:
        await engine.dispose()


def test_the_sqlalchemy_pool_capacity_is_read_where_pgcoord_expects_it() -> None:
    """Guard for the one private attribute read: QueuePool's _max_overflow."""
    engine = create_async_engine("postgresql+asyncpg://u@127.0.0.1:1/x", pool_size=3, max_overflow=4)
    assert statements._pool_capacity(engine) == 7
    unbounded = create_async_engine("postgresql+asyncpg://u@127.0.0.1:1/x", max_overflow=-1)
    assert statements._pool_capacity(unbounded) is None


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_a_pool_of_two_renews_while_the_body_holds_a_connection(kind: str, dsn: str) -> None:
    name = unique("lease:two")
    async with open_async(kind, dsn, size=2) as source:
        if kind.startswith("sa-"):
            source.pool._max_overflow = 0  # pool_size=2, no overflow: two connections at most
        lease = pgcoord.Lease(source, name, ttl=0.6)
        async with lease:
            if kind == "asyncpg-pool":
                async with source.acquire() as conn:
                    await conn.execute("select pg_sleep(1.2)")
            elif kind == "psycopg-pool":
                async with source.connection() as conn:
                    await conn.execute("select pg_sleep(1.2)")
            else:
                async with source.connect() as conn:
                    await conn.exec_driver_sql("select pg_sleep(1.2)")
            assert lease.valid


async def _borrow(kind: str, source: Any) -> tuple[Any, Any]:
    """Check a connection out of ``source``; (connection, how to give it back)."""
    if kind == "asyncpg-pool":
        conn = await source.acquire()
        return conn, lambda: source.release(conn)
    if kind == "psycopg-pool":
        conn = await source.getconn()
        return conn, lambda: source.putconn(conn)
    conn = await source.connect()
    return conn, conn.close


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_a_body_holding_every_connection_loses_the_lease_at_the_window_and_is_told_why(
    kind: str, dsn: str,
) -> None:
    """A renewal that cannot get a connection waits for the pool only until the trust
    window closes (not the pool's own timeout), and the loss says why."""
    name = unique("lease:starved")
    async with open_async(kind, dsn, size=2) as source:
        if kind.startswith("sa-"):
            source.pool._max_overflow = 0  # pool_size=2, no overflow: two connections at most
        lease = pgcoord.Lease(source, name, ttl=0.9)
        started = 0.0
        with pytest.raises(pgcoord.LeaseLost, match="no free connection"):
            async with lease:
                held = [await _borrow(kind, source) for _ in range(2)]
                started = time.monotonic()
                try:
                    await asyncio.sleep(30)
                finally:
                    for _, give_back in held:
                        await give_back()
        assert time.monotonic() - started < 0.9 + 1.5
        # The release had a connection again: the lease is free at once, not at expiry.
        assert sql(dsn, "select holder from pgcoord.leases where name = %s", name) == [(None,)]


# -- 5. renewals survive a restart; a long outage loses the lease, not the process ------------

@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    # synchronous_commit on: an immediate shutdown must not lose committed lease rows
    # (with it off, commits of the last few hundred ms may be lost, as after a crash).
    with EmbeddedServer({"synchronous_commit": "on"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_a_lease_survives_a_server_restart_shorter_than_its_trust_window(
    kind: str, own_server: EmbeddedServer,
) -> None:
    dsn = own_server.dsn
    name = unique("lease:restart")
    async with open_async(kind, dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=4.5)
        async with lease as fence:
            restarting = time.time()
            await asyncio.to_thread(own_server.restart)
            await asyncio.sleep(2.0)  # more than one renewal period (ttl/3) after the restart
            assert lease.valid and lease.fence == fence
            [(renewed,)] = sql(dsn, "select extract(epoch from renewed_at) from pgcoord.leases"
                                    " where name = %s", name)
            assert float(renewed) > restarting  # type: ignore[arg-type]
        assert sql(dsn, "select holder from pgcoord.leases where name = %s", name) == [(None,)]


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_an_outage_past_the_trust_window_loses_the_lease_and_the_next_acquire_works(
    kind: str, own_server: EmbeddedServer,
) -> None:
    dsn = own_server.dsn
    name = unique("lease:outage")
    async with open_async(kind, dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=1.5)
        lost_at = 0.0
        try:
            with pytest.raises(pgcoord.LeaseLost):
                async with lease as fence:
                    own_server._shutdown(signal.SIGQUIT)
                    down_at = time.monotonic()
                    try:
                        await asyncio.sleep(30)
                    finally:
                        lost_at = time.monotonic()
            assert lost_at - down_at < 1.5 + 1.0
        finally:
            await asyncio.to_thread(own_server._spawn)
        # The same Lease takes the lease again once the server is back.
        again = pgcoord.Lease(source, name, ttl=5)
        deadline = time.monotonic() + 15
        while True:
            try:
                new_fence = await again.acquire(timeout=10)
                break
            except pgcoord.PgcoordError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        assert new_fence == fence + 1
        await again.release()


def _server_processes(server: EmbeddedServer) -> list[int]:
    """The postmaster and its children (each backend is a session of its own)."""
    assert server._proc is not None
    postmaster = server._proc.pid
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry))
    return pids


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_a_frozen_server_loses_the_lease_within_the_window_and_the_bound(
    kind: str, own_server: EmbeddedServer, short_release: float,
) -> None:
    """The server stops answering (partition, hung host): renewals cannot finish, the
    body gets LeaseLost when the trust window closes, and the release that cannot reach
    the server holds the exit up by its bound at most."""
    dsn = own_server.dsn
    name = unique("lease:frozen")
    async with open_async(kind, dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=1.5)
        pids: list[int] = []
        try:
            with pytest.raises(pgcoord.LeaseLost):
                async with lease:
                    pids = _server_processes(own_server)
                    for pid in pids:
                        os.kill(pid, signal.SIGSTOP)
                    frozen_at = time.monotonic()
                    await asyncio.sleep(30)
            assert time.monotonic() - frozen_at < 1.5 + short_release + 1.5
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
