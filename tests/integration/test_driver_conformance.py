"""One set of behaviours, run over every source kind pgcoord accepts (sources.py: 12
kinds over asyncpg, psycopg and SQLAlchemy, async and sync, pools and connections).

A kind that fails here fails for a reason its driver gives: the features above
``pgcoord._drivers`` are written once, against ``adapt()`` and the session
protocols. Each test opens its own source on the real test server; whatever is
held elsewhere is held by a plain psycopg connection, so no test depends on the
driver under test to set up or to check (``conftest.advisory_locks``, ``sql``).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.locks.semaphores
from pgcoord._drivers import adapt, driver_of
from pgcoord._drivers.capacity import pool_capacity

from .conftest import advisory_locks, semaphore_held_in_a_thread, sql, unique
from .sources import ASYNC_CONNS, ASYNC_POOLS, SYNC_CONNS, SYNC_POOLS, open_async, open_sync

KINDS = ASYNC_POOLS + ASYNC_CONNS + SYNC_POOLS + SYNC_CONNS

SIZE = 4  # what sources.py opens pools with; SQLAlchemy adds its max_overflow of 10
EXPECTED: dict[str, tuple[str, bool, int | None]] = {
    # kind: (driver, async, pool capacity; None for a connection)
    "asyncpg-pool": ("asyncpg", True, SIZE),
    "psycopg-pool": ("psycopg", True, SIZE),
    "sa-async-asyncpg": ("sqlalchemy", True, SIZE + 10),
    "sa-async-psycopg": ("sqlalchemy", True, SIZE + 10),
    "asyncpg-conn": ("asyncpg", True, None),
    "asyncpg-pooled-conn": ("asyncpg", True, None),
    "psycopg-conn": ("psycopg", True, None),
    "sa-async-conn": ("sqlalchemy", True, None),
    "psycopg-sync-pool": ("psycopg", False, SIZE),
    "sa-sync-engine": ("sqlalchemy", False, SIZE + 10),
    "psycopg-sync-conn": ("psycopg", False, None),
    "sa-sync-conn": ("sqlalchemy", False, None),
}
assert set(EXPECTED) == set(KINDS)

each_kind = pytest.mark.parametrize("kind", KINDS)


class Source:
    """One source of a kind, and the few things a test does with it that differ
    between async and sync and between drivers: test code, not pgcoord's."""

    def __init__(self, kind: str, obj: Any) -> None:
        self.kind, self.obj = kind, obj
        self.driver, self.is_async, capacity = EXPECTED[kind]
        self.is_pool = capacity is not None
        self.sqlalchemy = kind.startswith("sa-")

    @contextlib.asynccontextmanager
    async def exclusive(self, key: int | str, **options: Any) -> AsyncIterator[Any]:
        if self.is_async:
            async with pgcoord.exclusive(self.obj, key, **options) as conn:
                yield conn
        else:
            with pgcoord.exclusive(self.obj, key, **options) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def semaphore(self, name: str, **options: Any) -> AsyncIterator[Any]:
        if self.is_async:
            async with pgcoord.semaphore(self.obj, name, **options) as conn:
                yield conn
        else:
            with pgcoord.semaphore(self.obj, name, **options) as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """A connection of the user's own: one checked out of the pool, or the one given."""
        if not self.is_pool:
            yield self.obj
        elif self.kind == "asyncpg-pool":
            async with self.obj.acquire() as conn:
                yield conn
        elif self.kind == "psycopg-pool":
            async with self.obj.connection() as conn:
                yield conn
        elif self.kind == "psycopg-sync-pool":
            with self.obj.connection() as conn:
                yield conn
        elif self.is_async:  # a SQLAlchemy AsyncEngine
            async with self.obj.connect() as conn:
                yield conn
        else:
            with self.obj.connect() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def transaction(self, conn: Any) -> AsyncIterator[None]:
        """The user's own transaction on ``conn``, with the driver's API."""
        block = conn.begin() if self.sqlalchemy else conn.transaction()
        if self.is_async:
            async with block:
                yield
        else:
            with block:
                yield

    async def run(self, conn: Any, statement: str) -> tuple[Any, ...]:
        """``statement`` (no parameters) on ``conn``; its first row."""
        if self.sqlalchemy:
            result = conn.exec_driver_sql(statement)
            result = await result if self.is_async else result
            return tuple(result.one())
        if self.driver == "asyncpg":
            return tuple(await conn.fetchrow(statement))
        cur = conn.execute(statement)
        cur = await cur if self.is_async else cur
        row = cur.fetchone()
        return tuple(await row if self.is_async else row)

    async def pid(self, conn: Any) -> int:
        return int((await self.run(conn, "select pg_backend_pid()"))[0])

    async def autocommit(self, conn: Any) -> None:
        """Put ``conn`` in autocommit: statements outside any transaction."""
        if self.sqlalchemy:
            done = conn.execution_options(isolation_level="AUTOCOMMIT")
            if self.is_async:
                await done
        elif self.driver == "psycopg":
            if self.is_async:
                await conn.set_autocommit(True)
            else:
                conn.autocommit = True
        # asyncpg runs every statement outside a transaction unless told otherwise

    async def driver_autocommit(self, conn: Any) -> bool | None:
        """The autocommit switch of the driver connection under ``conn`` (psycopg's;
        None for asyncpg, which has none)."""
        if self.sqlalchemy:
            raw = (await conn.get_raw_connection()) if self.is_async else conn.connection
            conn = raw.driver_connection
        return getattr(conn, "autocommit", None)

    async def check_fence(self, conn: Any, name: str, fence: int) -> None:
        result = pgcoord.check_fence(conn, name, fence)
        if self.is_async:
            await result


@contextlib.asynccontextmanager
async def opened(kind: str, dsn: str, size: int = SIZE) -> AsyncIterator[Source]:
    if EXPECTED[kind][1]:
        async with open_async(kind, dsn, size) as obj:
            yield Source(kind, obj)
    else:
        with open_sync(kind, dsn, size) as obj:
            yield Source(kind, obj)


def session_state(dsn: str, pid: int) -> str:
    """What the server says session ``pid`` is doing ("idle", "idle in transaction")."""
    return str(sql(dsn, "select state from pg_stat_activity where pid = %s", pid)[0][0])


def locks_of(dsn: str, pid: int) -> list[tuple[int, int, bool]]:
    return [lock for lock in advisory_locks(dsn) if lock[0] == pid]


def other_key() -> int:
    return random.randrange(1, 2**62)


# -- what the source is ---------------------------------------------------------------------

@each_kind
async def test_adapt_says_what_the_source_is(kind: str, dsn: str) -> None:
    driver, is_async, capacity = EXPECTED[kind]
    async with opened(kind, dsn) as src:
        adapter = adapt(src.obj)
        assert (adapter.driver, adapter.is_async, adapter.is_pool) == (driver, is_async, capacity is not None)
        assert adapt(src.obj) is adapter, "one adapter per type"
        assert driver_of(src.obj) == driver
        assert pool_capacity(src.obj) == capacity
        async with src.connection() as conn, src.transaction(conn):
            # Under any connection, the driver's own (asyncpg's or psycopg's), same session.
            raw = adapt(conn).driver_connection(conn)
            assert driver_of(raw) in ("asyncpg", "psycopg")
            announced = (raw.get_server_pid() if isinstance(raw, asyncpg.Connection)
                         else raw.info.backend_pid)
            assert announced == await src.pid(conn)


# -- exclusive() ---------------------------------------------------------------------------

@each_kind
async def test_exclusive_holds_the_key_in_a_transaction_and_releases_it(kind: str, dsn: str) -> None:
    name = unique("conformance")
    key = pgcoord.lock_key(name)
    async with opened(kind, dsn) as src:
        async with src.exclusive(name) as conn:
            pid = await src.pid(conn)
            assert locks_of(dsn, pid) == [(pid, key, True)]
            assert session_state(dsn, pid) == "idle in transaction"
        assert locks_of(dsn, pid) == []
        assert session_state(dsn, pid) == "idle"
        with pytest.raises(RuntimeError):  # a body that raises rolls back, and releases too
            async with src.exclusive(name, shared=True) as conn:
                pid = await src.pid(conn)  # a pool may lend another connection this time
                assert locks_of(dsn, pid) == [(pid, key, True)]
                raise RuntimeError
        assert locks_of(dsn, pid) == []


@each_kind
async def test_busy_and_timeout_while_another_session_holds_the_key(kind: str, dsn: str) -> None:
    key = other_key()
    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("select pg_advisory_lock(%s)", (key,))
        async with opened(kind, dsn) as src:
            with pytest.raises(pgcoord.LockBusy):
                async with src.exclusive(key, wait=False):
                    pytest.fail("granted while held elsewhere")
            started = time.monotonic()
            with pytest.raises(pgcoord.LockTimeout):
                async with src.exclusive(key, timeout=0.1):
                    pytest.fail("granted while held elsewhere")
            assert time.monotonic() - started < 5
            other.execute("select pg_advisory_unlock(%s)", (key,))
            # The failed attempts left the source usable: the key is had once free.
            async with src.exclusive(key, wait=False) as conn:
                pid = await src.pid(conn)
                assert locks_of(dsn, pid) == [(pid, key, True)]
            assert locks_of(dsn, pid) == []


@each_kind
async def test_the_connection_goes_back_as_it_came(kind: str, dsn: str) -> None:
    """No transaction, no advisory lock, the same settings and the same autocommit
    switch, after a lock with a timeout (SET LOCAL lock_timeout) that committed and
    one whose body raised. A pool of one connection lends the same one each time."""
    probe = ("select pg_backend_pid(), current_setting('lock_timeout'), "
             "current_setting('statement_timeout'), current_setting('default_transaction_isolation'), "
             "current_setting('application_name')")

    async def state(src: Source) -> tuple[Any, ...]:
        async with src.connection() as conn:
            async with src.transaction(conn):
                row = await src.run(conn, probe)
            return (*row, await src.driver_autocommit(conn))

    async with opened(kind, dsn, size=1) as src:
        before = await state(src)
        pid = before[0]
        name = unique("clean")
        async with src.exclusive(name, timeout=5) as conn:
            assert await src.pid(conn) == pid
            assert (await src.run(conn, "select current_setting('lock_timeout')"))[0] == before[1]
        with pytest.raises(ZeroDivisionError):
            async with src.exclusive(name, timeout=5):
                1 / 0  # noqa: B018
        assert session_state(dsn, pid) == "idle"
        assert locks_of(dsn, pid) == []
        assert await state(src) == before


@each_kind
async def test_the_wrong_with_says_which_with_to_use(kind: str, dsn: str) -> None:
    async with opened(kind, dsn) as src:
        if src.is_async:
            with pytest.raises(TypeError, match="use `async with"), pgcoord.exclusive(src.obj, 1):  # type: ignore[attr-defined]
                pass
            with pytest.raises(TypeError, match="use `async with"), \
                    pgcoord.semaphore(src.obj, "conformance", limit=1):  # type: ignore[attr-defined]
                pass
        else:
            with pytest.raises(TypeError, match=r"use `with pgcoord\.exclusive"):
                async with pgcoord.exclusive(src.obj, 1):  # type: ignore[attr-defined]
                    pass
            with pytest.raises(TypeError, match=r"use `with pgcoord\.exclusive"):
                async with pgcoord.semaphore(src.obj, "conformance", limit=1):  # type: ignore[attr-defined]
                    pass


@each_kind
async def test_background_features_take_an_async_pool_only(kind: str, dsn: str) -> None:
    """Lease renews and LockHolder borrows in the background: an async pool or
    engine is taken, a bare connection is refused (UnsupportedConnection), a sync
    source too (Lease: TypeError, its twin is pgcoord.sync.Lease)."""
    async with opened(kind, dsn) as src:
        if src.is_async and src.is_pool:
            pgcoord.Lease(src.obj, unique("conformance-lease"), ttl=5)
            pgcoord.LockHolder(src.obj)
            return
        with pytest.raises(pgcoord.UnsupportedConnection if src.is_async else TypeError):
            pgcoord.Lease(src.obj, unique("conformance-lease"), ttl=5)
        with pytest.raises(pgcoord.UnsupportedConnection, match="LockHolder cannot use"):
            pgcoord.LockHolder(src.obj)


# -- semaphore() -------------------------------------------------------------------------

@each_kind
async def test_a_semaphore_waiter_gets_the_slot_another_session_frees(
    kind: str, dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait LISTENs on the source's own driver connection (asyncpg's listener,
    psycopg's notify handler and socket watch, also under SQLAlchemy)."""
    monkeypatch.setattr(pgcoord.locks.semaphores, "SEMAPHORE_RECHECK", 60.0)
    name = unique("conformance-sem")
    with semaphore_held_in_a_thread(dsn, name) as release:
        async with opened(kind, dsn) as src:
            with pytest.raises(pgcoord.LockBusy):
                async with src.semaphore(name, limit=1, wait=False):
                    pytest.fail("a slot while every slot is taken")
            threading.Timer(0.2, release.set).start()
            started = time.monotonic()
            async with src.semaphore(name, limit=1, timeout=10) as conn:
                waited = time.monotonic() - started
                pid = await src.pid(conn)
            assert 0.1 < waited < 5, waited
            assert locks_of(dsn, pid) == []


# -- check_fence ---------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def held_lease(dsn: str) -> AsyncIterator[tuple[str, int]]:
    name = unique("conformance-lease")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        lease = pgcoord.Lease(pool, name, ttl=30)
        fence = await lease.acquire()
        try:
            yield name, fence
        finally:
            await lease.release()
    finally:
        await pool.close()


@each_kind
async def test_check_fence_in_and_outside_a_transaction(kind: str, dsn: str) -> None:
    async with held_lease(dsn) as (name, fence), opened(kind, dsn) as src:
        if src.is_pool:
            with pytest.raises(pgcoord.UnsupportedConnection, match="not a pool"):
                await src.check_fence(src.obj, name, fence)
        async with src.connection() as conn:
            async with src.transaction(conn):
                await src.check_fence(conn, name, fence)  # current: passes
            with pytest.raises(pgcoord.StaleFence, match="stale fence"):
                async with src.transaction(conn):
                    await src.check_fence(conn, name, fence - 1)
            # Outside a transaction the row lock would end with the check: refused.
            await src.autocommit(conn)
            with pytest.raises(pgcoord.PgcoordError, match="outside a transaction"):
                await src.check_fence(conn, name, fence)
