"""LockHolder under hostile conditions (issue 11): pools of one connection,
locks that must wait on a pool that cannot lend, give-backs that hang, sessions
lost from a pool, and connections that must go back exactly as they came."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import psycopg_pool
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import StaticPool

import pgcoord

from .conftest import advisory_locks, sql
from .proxy import FreezableProxy
from .test_exclusive import Blocker, blocker  # noqa: F401 - fixture

POOL_KINDS = ["asyncpg-pool", "psycopg-pool", "sa-engine-asyncpg", "sa-engine-psycopg"]


@contextlib.asynccontextmanager
async def pool_of(
    kind: str, dsn: str, size: int, *, timeout: float = 10.0,  # noqa: ASYNC109 - the pool's
    configure: Callable[[Any], Any] | None = None,
) -> AsyncIterator[Any]:
    """A pool (or engine) of at most ``size`` connections that gives up lending
    after ``timeout`` seconds (asyncpg's pool has no such timeout: it waits)."""
    if kind == "asyncpg-pool":
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size)
        try:
            yield pool
        finally:
            pool.terminate()
    elif kind == "psycopg-pool":
        async with psycopg_pool.AsyncConnectionPool(
            dsn, min_size=1, max_size=size, timeout=timeout, open=False, configure=configure,
        ) as pool:
            yield pool
    else:
        driver = kind.removeprefix("sa-engine-")
        engine = create_async_engine(dsn.replace("postgresql://", f"postgresql+{driver}://"),
                                     pool_size=size, max_overflow=0, pool_timeout=timeout)
        if configure is not None:
            event.listen(engine.sync_engine, "connect", lambda dbapi_conn, _rec: configure(dbapi_conn))
        try:
            yield engine
        finally:
            await engine.dispose()


async def borrowed_pids(kind: str, pool: Any, count: int) -> set[int]:
    """Borrow ``count`` connections at once and return their server pids."""
    async with contextlib.AsyncExitStack() as stack:
        pids = set()
        for _ in range(count):
            if kind == "asyncpg-pool":
                conn = await stack.enter_async_context(pool.acquire())
                pids.add(await conn.fetchval("select pg_backend_pid()"))
            elif kind == "psycopg-pool":
                conn = await stack.enter_async_context(pool.connection())
                pids.add((await (await conn.execute("select pg_backend_pid()")).fetchone())[0])
            else:
                from sqlalchemy import text

                conn = await stack.enter_async_context(pool.connect())
                pids.add((await conn.execute(text("select pg_backend_pid()"))).scalar())
        return pids


def held_by(dsn: str, pid: int | None) -> list[int]:
    return sorted(key for p, key, granted in advisory_locks(dsn) if p == pid and granted)


async def eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def waiting_count(dsn: str) -> int:
    return sum(1 for _, _, granted in advisory_locks(dsn) if not granted)


# -- a pool of one connection ---------------------------------------------------------------

@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_pool_of_one_connection_serves_a_holder(kind: str, dsn: str) -> None:
    async with pool_of(kind, dsn, 1, timeout=10.0) as pool, asyncio.timeout(60):
        started = time.monotonic()
        async with pgcoord.LockHolder(pool) as holder:
            # The pool gives up after 10 s: nobody waited it out.
            assert time.monotonic() - started < 5
            async with holder.lock("hostile:one", wait=False):
                assert held_by(dsn, holder.backend_pid) == [pgcoord.lock_key("hostile:one")]
            async with holder.lock("hostile:one"):  # free: no second connection needed
                pass
        assert advisory_locks(dsn) == []
        assert len(await borrowed_pids(kind, pool, 1)) == 1  # and the pool lends it again


@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_lock_that_must_wait_is_refused_at_once_when_the_pool_cannot_lend(
    kind: str, dsn: str, blocker: Blocker,  # noqa: F811
) -> None:
    blocker.hold("hostile:contended")
    async with pool_of(kind, dsn, 1, timeout=10.0) as pool, asyncio.timeout(60), \
            pgcoord.LockHolder(pool) as holder:
        started = time.monotonic()
        with pytest.raises(pgcoord.PoolExhausted, match="pool has none to lend"):
            async with holder.lock("hostile:contended", timeout=30):
                pytest.fail("body ran")
        assert time.monotonic() - started < 3
        # The holder carries on, holding nothing it should not.
        async with holder.lock("hostile:free", wait=False):
            pass
        await holder.flush()
        assert held_by(dsn, holder.backend_pid) == []


async def test_locks_that_wait_use_at_most_max_wait_connections(
    dsn: str, blocker: Blocker,  # noqa: F811
) -> None:
    keys = [f"hostile:many:{i}" for i in range(3)]
    for key in keys:
        blocker.hold(key)
    app = "hostile-bounded"
    async with pgcoord.LockHolder(dsn, application_name=app, max_wait_connections=2) as holder:
        granted: list[str] = []

        async def take(key: str) -> None:
            async with holder.lock(key):
                granted.append(key)

        tasks = [asyncio.create_task(take(key)) for key in keys[:2]]
        await eventually(lambda: waiting_count(dsn) == 2)
        started = time.monotonic()
        with pytest.raises(pgcoord.PoolExhausted, match="max_wait_connections=2"):
            async with holder.lock(keys[2]):
                pytest.fail("body ran")
        assert time.monotonic() - started < 3
        sessions = sql(dsn, "select count(*) from pg_stat_activity where application_name = %s",
                       app)
        assert sessions == [(3,)]  # the main one and two waiting ones
        blocker.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert sorted(granted) == keys[:2]
        # Their connections went away with their locks: another lock may wait now.
        blocker.hold(keys[2])
        task = asyncio.create_task(take(keys[2]))
        await eventually(lambda: waiting_count(dsn) == 1)
        blocker.release()
        await asyncio.wait_for(task, 10)
    assert advisory_locks(dsn) == []


async def test_closing_the_holder_ends_a_wait_at_once(
    dsn: str, blocker: Blocker,  # noqa: F811
) -> None:
    blocker.hold("hostile:closing")
    holder = pgcoord.LockHolder(dsn, keepalive=30)
    await holder.open()

    async def take() -> None:
        async with holder.lock("hostile:closing"):
            pytest.fail("granted")

    task = asyncio.create_task(take())
    await eventually(lambda: waiting_count(dsn) == 1)
    started = time.monotonic()
    await holder.close()
    assert time.monotonic() - started < 2
    with pytest.raises(pgcoord.LockLost, match="closed"):
        await asyncio.wait_for(task, 5)
    await eventually(lambda: waiting_count(dsn) == 0)


def test_max_wait_connections_is_checked_at_construction() -> None:
    with pytest.raises(ValueError):
        pgcoord.LockHolder("postgresql://x/y", max_wait_connections=-1)
    with pytest.raises(ValueError):
        pgcoord.LockHolder("postgresql://x/y", max_wait_connections=1.5)  # type: ignore[arg-type]


async def test_an_engine_that_shares_one_connection_is_refused(dsn: str) -> None:
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"),
                                 poolclass=StaticPool)
    try:
        with pytest.raises(pgcoord.UnsupportedConnection, match="StaticPool"):
            pgcoord.LockHolder(engine)
    finally:
        await engine.dispose()


# -- a session lost from a pool ------------------------------------------------------------

@pytest.mark.parametrize("kind", POOL_KINDS)
async def test_a_lost_session_gives_its_pool_slot_back(kind: str, dsn: str) -> None:
    async with pool_of(kind, dsn, 1, timeout=10.0) as pool, asyncio.timeout(60), \
            pgcoord.LockHolder(pool, keepalive=1.0) as holder:
        pid = holder.backend_pid
        with pytest.raises(pgcoord.LockLost):
            async with holder.lock("hostile:lost"):
                sql(dsn, "select pg_terminate_backend(%s)", pid)
                await asyncio.sleep(10)
        # Reconnecting borrows again from the pool of one: its slot came back.
        started = time.monotonic()
        async with holder.lock("hostile:lost", wait=False):
            assert holder.backend_pid != pid
        assert time.monotonic() - started < 5
    assert advisory_locks(dsn) == []


# -- give-backs that hang ---------------------------------------------------------------------

@pytest.fixture
def proxy(dsn: str) -> Any:
    p = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]))
    yield p
    p.close()


BOUND = 5.0  # LockHolder's cleanup bound with keepalive >= 5
SLACK = 3.0


@pytest.mark.parametrize("kind", ["dsn-asyncpg", "dsn-psycopg", *POOL_KINDS])
async def test_closing_a_holder_whose_give_back_hangs_ends_within_its_bound(
    kind: str, dsn: str, proxy: FreezableProxy,
) -> None:
    via = proxy.dsn(dsn)
    async with contextlib.AsyncExitStack() as stack:
        if kind.startswith("dsn-"):
            source, extra = via, {"driver": kind.removeprefix("dsn-")}
        else:
            source, extra = await stack.enter_async_context(pool_of(kind, via, 2)), {}
        # keepalive 30: probes come every 15 s, so the bound is what ends the wait.
        holder = pgcoord.LockHolder(source, keepalive=30, **extra)
        await holder.open()
        pid = holder.backend_pid
        async with holder.lock("hostile:hang", wait=False):
            assert held_by(dsn, pid) == [pgcoord.lock_key("hostile:hang")]
        proxy.freeze()
        started = time.monotonic()
        await holder.close()  # no exception: the caller's own outcome is a normal return
        assert time.monotonic() - started < BOUND + SLACK
        proxy.frozen.clear()
        # The server hears of it once the network is back, and the locks go.
        await eventually(lambda: held_by(dsn, pid) == [])
        if not kind.startswith("dsn-"):
            # Closed, not returned: nothing the pool lends is that session.
            assert pid not in await borrowed_pids(kind, source, 2)


@pytest.mark.parametrize("kind", ["dsn-asyncpg", "dsn-psycopg", *POOL_KINDS])
async def test_leaving_a_lock_that_waited_when_its_give_back_hangs_keeps_the_body_outcome(
    kind: str, dsn: str, proxy: FreezableProxy, blocker: Blocker,  # noqa: F811
) -> None:
    via = proxy.dsn(dsn)
    async with contextlib.AsyncExitStack() as stack:
        if kind.startswith("dsn-"):
            source, extra = via, {"driver": kind.removeprefix("dsn-")}
        else:
            source, extra = await stack.enter_async_context(pool_of(kind, via, 3)), {}
        holder = await stack.enter_async_context(
            pgcoord.LockHolder(source, keepalive=30, **extra))
        blocker.hold("hostile:waited")
        entered, leave = asyncio.Event(), asyncio.Event()

        async def body() -> None:
            async with holder.lock("hostile:waited"):
                entered.set()
                await leave.wait()
                raise ValueError("the body's own error")

        task = asyncio.create_task(body())
        await eventually(lambda: waiting_count(dsn) == 1)
        blocker.release()
        await asyncio.wait_for(entered.wait(), 10)
        proxy.freeze()
        leave.set()
        started = time.monotonic()
        with pytest.raises(ValueError, match="the body's own error"):
            await task
        assert time.monotonic() - started < BOUND + SLACK
        proxy.frozen.clear()
    await eventually(lambda: advisory_locks(dsn) == [])


async def test_a_cancelled_try_whose_cleanup_hangs_ends_within_its_bound(
    dsn: str, proxy: FreezableProxy,
) -> None:
    # asyncpg: the cancel is ours to handle at once. (psycopg handles a cancelled
    # statement itself first: it sends a cancel request and waits up to 5 s for
    # it, then up to 5 s for the statement to end.)
    holder = pgcoord.LockHolder(proxy.dsn(dsn), driver="asyncpg", keepalive=30)
    await holder.open()
    pid = holder.backend_pid
    # Once before the freeze, so that the name is recorded (a statement of its own
    # before a key's first try in a process) and the freeze cuts the try itself.
    async with holder.lock("hostile:cancelled"):
        pass
    proxy.freeze()

    async def take() -> None:
        async with holder.lock("hostile:cancelled"):
            pytest.fail("granted on a frozen network")

    task = asyncio.create_task(take())
    await asyncio.sleep(0.3)  # the try is on the wire, unanswered
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < BOUND + SLACK
    proxy.frozen.clear()
    # Unsure whether the try was granted, the holder dropped that session.
    await eventually(lambda: held_by(dsn, pid) == [])
    async with holder.lock("hostile:cancelled", wait=False):
        assert holder.backend_pid != pid
    await holder.close()
    assert advisory_locks(dsn) == []


# -- a connection goes back exactly as it came out ------------------------------------------------

async def _configure_psycopg(conn: Any) -> None:
    await conn.set_autocommit(True)
    await conn.execute("set application_name = 'app-configured'")
    await conn.execute("set tcp_user_timeout = 4321")
    await conn.set_autocommit(False)


def _configure_sa(dbapi_conn: Any) -> None:
    dbapi_conn.autocommit = True
    cur = dbapi_conn.cursor()
    cur.execute("set application_name = 'app-configured'")
    cur.execute("set tcp_user_timeout = 4321")
    cur.close()
    dbapi_conn.autocommit = False


@pytest.mark.parametrize("kind", ["psycopg-pool", "sa-engine-psycopg"])
async def test_a_borrowed_connection_goes_back_with_the_settings_it_came_with(
    kind: str, dsn: str,
) -> None:
    configure = _configure_psycopg if kind == "psycopg-pool" else _configure_sa
    async with pool_of(kind, dsn, 1, configure=configure) as pool:
        async def observe() -> tuple[Any, ...]:
            if kind == "psycopg-pool":
                async with pool.connection() as conn:
                    row = await (await conn.execute(
                        "select current_setting('application_name'),"
                        " current_setting('tcp_user_timeout'),"
                        " current_setting('tcp_keepalives_idle'),"
                        " current_setting('client_connection_check_interval'), pg_backend_pid()")).fetchone()
                    return (*row, conn.autocommit)
            from sqlalchemy import text

            async with pool.connect() as conn:
                row = (await conn.execute(text(
                    "select current_setting('application_name'),"
                    " current_setting('tcp_user_timeout'),"
                    " current_setting('tcp_keepalives_idle'),"
                    " current_setting('client_connection_check_interval'), pg_backend_pid()"))).one()
                raw = await conn.get_raw_connection()
                autocommit = raw.driver_connection.autocommit
                await conn.rollback()
                return (*row, autocommit)

        before = await observe()
        assert before[:2] == ("app-configured", "4321")
        async with pgcoord.LockHolder(pool, keepalive=2.0) as holder, \
                holder.lock("hostile:settings", wait=False):
            pass
        after = await observe()
        assert after == before  # same session, same settings, same autocommit


async def test_closing_a_holder_under_a_body_that_holds_a_lock_is_lock_lost(dsn: str) -> None:
    """Review finding: close() gives the connection back (unlocking everything);
    a body still inside its `async with` must be told, never run on unlocked."""
    import asyncio as _asyncio

    holder = pgcoord.LockHolder(dsn)
    await holder.open()
    inside = _asyncio.Event()

    async def body() -> None:
        async with holder.lock("close-under-body"):
            inside.set()
            await _asyncio.sleep(30)

    task = _asyncio.ensure_future(body())
    await _asyncio.wait_for(inside.wait(), 5)
    await holder.close()
    with pytest.raises(pgcoord.LockLost):
        await _asyncio.wait_for(task, 5)
