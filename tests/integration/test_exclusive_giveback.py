"""A connection goes back exactly as it came out, on every path out of exclusive().

Issue #11, item 1: exclusive() switches a psycopg connection to autocommit to send
BEGIN and the lock in one message, and a COMMIT that failed (a deferred foreign
key, a serialization failure) or was cancelled returned it to its pool still in
autocommit, so every later "transaction" of the next borrower committed statement
by statement. Each source here holds one connection (a pool of size 1, or a bare
connection), so the next borrower gets that very connection; what it finds must
equal what the first borrower found: autocommit, isolation, read-only,
deferrable, session settings, no transaction, no advisory lock, and a
transaction of its own that is really a transaction. The caller gets its own
outcome (the FK error, LockBusy, its CancelledError).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgcoord
from pgcoord._drivers.psycopg import GUARD_CANCEL

from .conftest import sql, unique
from .small_pools import (
    ASYNC_KINDS,
    PSYCOPG_UNDERNEATH,
    SYNC_KINDS,
    observe,
    open_async,
    open_sync,
    pid_of,
    same_but_pid,
    state_async,
    state_sync,
)


class Boom(Exception):
    pass


@pytest.fixture
def tables(dsn: str) -> Iterator[str]:
    """Tables named ``<prefix>_parent``, ``_child`` (a DEFERRABLE INITIALLY DEFERRED
    foreign key), ``_ssi`` (for write skew) and ``_slow`` (its COMMIT sleeps 3 s in
    a deferred constraint trigger, so a test can cancel during COMMIT)."""
    p = "gb_" + uuid.uuid4().hex[:8]
    sql(dsn, f"""
        create table {p}_parent (id int primary key);
        create table {p}_child (id int, parent int references {p}_parent
                                deferrable initially deferred);
        create table {p}_ssi (g int, v int);
        create table {p}_slow (id int);
        create function {p}_sleep() returns trigger language plpgsql
            as $$ begin perform pg_sleep(3); return null; end $$;
        create constraint trigger {p}_slow_commit after insert on {p}_slow
            deferrable initially deferred for each row execute function {p}_sleep();
    """)
    yield p
    sql(dsn, f"drop table {p}_parent, {p}_child, {p}_ssi, {p}_slow cascade;"
             f" drop function {p}_sleep()")


def sqlstate_in(exc: BaseException) -> str | None:
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        for attr in ("sqlstate", "pgcode"):
            code = getattr(e, attr, None)
            if isinstance(code, str) and len(code) == 5:
                return code
        todo += [e.__cause__, getattr(e, "orig", None)]
    return None


async def aexec(conn: Any, statement: str) -> Any:
    """One statement through the connection the body was given; its first row."""
    if hasattr(conn, "exec_driver_sql"):
        result = await conn.exec_driver_sql(statement)
        return result.first() if result.returns_rows else None
    if hasattr(conn, "get_server_pid"):
        return await conn.fetchrow(statement)
    cur = await conn.execute(statement)
    return await cur.fetchone() if cur.description else None


def sexec(conn: Any, statement: str) -> Any:
    if hasattr(conn, "exec_driver_sql"):
        result = conn.exec_driver_sql(statement)
        return result.first() if result.returns_rows else None
    cur = conn.execute(statement)
    return cur.fetchone() if cur.description else None


class Other:
    """A second, SERIALIZABLE session for write skew, and a lock blocker."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, application_name="gb-other")
        self.conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def other(dsn: str) -> Iterator[Other]:
    o = Other(dsn)
    yield o
    o.close()


def commits(dsn: str, table: str) -> int:
    return int(sql(dsn, f"select count(*) from {table}")[0][0])  # type: ignore[call-overload]


# -- async sources --------------------------------------------------------------

ASYNC_MODES = ["deferred-fk", "serialization", "body-error", "busy", "timeout", "cancel-wait",
               "cancel-commit", "ok"]


async def _wait_until(pred: Any, what: str, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"timed out waiting until {what}")


@pytest.mark.parametrize("mode", ASYNC_MODES)
@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_async_connection_comes_back_as_it_came_out(
    kind: str, mode: str, dsn: str, tables: str, other: Other,
) -> None:
    p = tables
    key = unique("giveback")
    serializable = mode == "serialization"
    async with open_async(kind, dsn, serializable=serializable) as source:
        before = await state_async(kind, source, dsn)
        assert before["inside"][0] == "idle in transaction", before
        pid: list[int] = []

        async def body() -> None:
            async with pgcoord.exclusive(source, key, timeout=0.2 if mode == "timeout" else None,
                                         wait=mode != "busy") as conn:
                pid.append(await _pid(conn))
                if mode == "deferred-fk":
                    await aexec(conn, f"insert into {p}_child values (1, 999)")
                elif mode == "serialization":
                    # Write skew: each reads what the other writes. The other
                    # commits first, so this COMMIT is the one that must fail.
                    await aexec(conn, f"select count(*) from {p}_ssi where g = 1")
                    other.conn.execute(f"select count(*) from {p}_ssi where g = 2")
                    await aexec(conn, f"insert into {p}_ssi values (2, 1)")
                    other.conn.execute(f"insert into {p}_ssi values (1, 1)")
                    other.conn.commit()
                elif mode == "body-error":
                    await aexec(conn, f"insert into {p}_parent values (1)")
                    raise Boom
                elif mode == "cancel-commit":
                    await aexec(conn, f"insert into {p}_slow values (1)")
                else:
                    await aexec(conn, f"insert into {p}_parent values (1)")

        if mode in ("busy", "timeout", "cancel-wait"):
            other.conn.execute("select pg_advisory_xact_lock(%s)", (pgcoord.lock_key(key),))
        if mode in ("cancel-wait", "cancel-commit"):
            task = asyncio.create_task(body())
            if mode == "cancel-wait":
                await _wait_until(lambda: _waiting_on(dsn, pgcoord.lock_key(key)), "the lock is awaited")
            else:
                await _wait_until(lambda: bool(pid) and _committing(dsn, pid[0]), "COMMIT runs")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif mode in ("deferred-fk", "serialization"):
            with pytest.raises(Exception) as info:
                await body()
            assert sqlstate_in(info.value) == ("23503" if mode == "deferred-fk" else "40001"), \
                f"the caller gets the COMMIT's own error, not {info.value!r}"
        elif mode == "body-error":
            with pytest.raises(Boom):
                await body()
        elif mode == "busy":
            with pytest.raises(pgcoord.LockBusy):
                await body()
        elif mode == "timeout":
            with pytest.raises(pgcoord.LockTimeout):
                await body()
        else:
            await body()
        other.conn.rollback()
        discards = mode == "cancel-commit" or (
            mode == "cancel-wait" and GUARD_CANCEL and kind in PSYCOPG_UNDERNEATH)
        if mode == "cancel-wait" and discards:
            # psycopg < 3.2 cannot cancel without blocking the event loop: the
            # connection was closed instead, and its wait, still queued on the
            # server, ends as soon as the lock is granted to it.
            await _wait_until(lambda: _key_free(dsn, key), "the abandoned wait is over", seconds=15)
            if "conn" in kind:
                await _wait_until(lambda: _closed(source), "the connection is closed")
                return
        if mode == "cancel-commit":
            # Where the driver closes the connection on cancellation instead of
            # cancelling the statement (SQLAlchemy 2.0 over asyncpg 0.29), the
            # server finishes the COMMIT it was given, and its lock goes when it
            # ends: the outcome of a cancelled COMMIT is the server's to decide.
            await _wait_until(lambda: observe(dsn, pid[0]) in ((None, []), ("idle", [])),
                              "the cut-off COMMIT is over", seconds=15)

        after = await state_async(kind, source, dsn)
        now, then = same_but_pid(after, before)
        assert now == then
        if not discards:  # nothing there calls for discarding the connection
            assert after["pid"] == before["pid"], "the connection was discarded for no reason"
        assert commits(dsn, f"{p}_parent") == (1 if mode == "ok" else 0)
        assert commits(dsn, f"{p}_child") == 0
        # And the source still takes the lock, with the same single connection.
        async with pgcoord.exclusive(source, key, wait=False) as conn:
            await aexec(conn, "select 1")
        assert observe(dsn, after["pid"]) in ((None, []), ("idle", []))


async def _pid(conn: Any) -> int:
    if hasattr(conn, "exec_driver_sql"):
        return pid_of((await conn.get_raw_connection()).driver_connection)
    return pid_of(conn)


def _key_free(dsn: str, key: str) -> bool:
    """Nobody holds or waits for ``key``."""
    return not sql(dsn, "select 1 from pg_locks where locktype = 'advisory'"
                        " and ((classid::bigint << 32) | objid::bigint) = %s", pgcoord.lock_key(key))


def _closed(conn: Any) -> bool:
    if hasattr(conn, "invalidated"):
        return bool(conn.invalidated)
    return bool(conn.closed)


def _waiting_on(dsn: str, key: int) -> bool:
    return bool(sql(dsn, "select 1 from pg_locks where locktype = 'advisory' and not granted"
                         " and ((classid::bigint << 32) | objid::bigint) = %s", key))


def _committing(dsn: str, pid: int) -> bool:
    return bool(sql(dsn, "select 1 from pg_stat_activity where pid = %s and state = 'active'"
                         " and query ilike '%%commit%%'", pid))


# -- sync sources ---------------------------------------------------------------

SYNC_MODES = ["deferred-fk", "serialization", "body-error", "busy", "timeout", "ok"]


@pytest.mark.parametrize("mode", SYNC_MODES)
@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_sync_connection_comes_back_as_it_came_out(
    kind: str, mode: str, dsn: str, tables: str, other: Other,
) -> None:
    p = tables
    key = unique("giveback")
    with open_sync(kind, dsn, serializable=mode == "serialization") as source:
        before = state_sync(kind, source, dsn)
        assert before["inside"][0] == "idle in transaction", before

        def body() -> None:
            with pgcoord.exclusive(source, key, timeout=0.2 if mode == "timeout" else None,
                                   wait=mode != "busy") as conn:
                if mode == "deferred-fk":
                    sexec(conn, f"insert into {p}_child values (1, 999)")
                elif mode == "serialization":
                    sexec(conn, f"select count(*) from {p}_ssi where g = 1")
                    other.conn.execute(f"select count(*) from {p}_ssi where g = 2")
                    sexec(conn, f"insert into {p}_ssi values (2, 1)")
                    other.conn.execute(f"insert into {p}_ssi values (1, 1)")
                    other.conn.commit()
                elif mode == "body-error":
                    sexec(conn, f"insert into {p}_parent values (1)")
                    raise Boom
                else:
                    sexec(conn, f"insert into {p}_parent values (1)")

        if mode in ("busy", "timeout"):
            other.conn.execute("select pg_advisory_xact_lock(%s)", (pgcoord.lock_key(key),))
        if mode in ("deferred-fk", "serialization"):
            with pytest.raises(Exception) as info:
                body()
            assert sqlstate_in(info.value) == ("23503" if mode == "deferred-fk" else "40001"), \
                f"the caller gets the COMMIT's own error, not {info.value!r}"
        elif mode == "body-error":
            with pytest.raises(Boom):
                body()
        elif mode == "busy":
            with pytest.raises(pgcoord.LockBusy):
                body()
        elif mode == "timeout":
            with pytest.raises(pgcoord.LockTimeout):
                body()
        else:
            body()
        other.conn.rollback()

        after = state_sync(kind, source, dsn)
        now, then = same_but_pid(after, before)
        assert now == then
        assert after["pid"] == before["pid"], "the connection was discarded for no reason"
        assert commits(dsn, f"{p}_parent") == (1 if mode == "ok" else 0)
        assert commits(dsn, f"{p}_child") == 0
        with pgcoord.exclusive(source, key, wait=False) as conn:
            sexec(conn, "select 1")
        assert observe(dsn, after["pid"]) == ("idle", [])


# -- small pools ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_async_one_connection_is_enough_the_first_time_a_name_is_used(kind: str, dsn: str) -> None:
    """The first use of a string name records it in pgcoord.lock_names; on a
    source of one connection that must not borrow a second one."""
    name = unique("small-pool")
    async with open_async(kind, dsn) as source:
        async with asyncio.timeout(10):
            async with pgcoord.exclusive(source, name) as conn:
                await aexec(conn, "select 1")
                assert sql(dsn, "select name from pgcoord.lock_names where key = %s",
                           pgcoord.lock_key(name)) == [(name,)]
            async with pgcoord.exclusive(source, name, wait=False):
                pass
        after = await state_async(kind, source, dsn)
        assert after["after"] == ("idle", [])


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_sync_one_connection_is_enough_the_first_time_a_name_is_used(kind: str, dsn: str) -> None:
    name = unique("small-pool")
    with open_sync(kind, dsn) as source:
        with pgcoord.exclusive(source, name) as conn:
            sexec(conn, "select 1")
            assert sql(dsn, "select name from pgcoord.lock_names where key = %s",
                       pgcoord.lock_key(name)) == [(name,)]
        with pgcoord.exclusive(source, name, wait=False):
            pass
        assert state_sync(kind, source, dsn)["after"] == ("idle", [])


# -- read-only, deferrable, serializable psycopg connections ----------------------


class Boom2(Exception):
    pass


@pytest.mark.parametrize("mode", ["ok", "body-error", "busy", "cancel-wait"])
@pytest.mark.parametrize("kind", ["psycopg-pool", "psycopg-conn"])
async def test_psycopg_read_only_deferrable_characteristics_come_back(
    kind: str, mode: str, dsn: str,
) -> None:
    """The characteristics pgcoord writes into its own BEGIN are the connection's,
    and the connection keeps them afterwards."""
    import psycopg_pool

    key = unique("giveback")
    # Not SERIALIZABLE: a SERIALIZABLE READ ONLY DEFERRABLE transaction waits for
    # a safe snapshot while a serializable writer is open, before any lock.
    other = Other(dsn)
    other.conn.isolation_level = None

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.set_isolation_level(psycopg.IsolationLevel.SERIALIZABLE)
        await conn.set_read_only(True)
        await conn.set_deferrable(True)

    async def open_source() -> Any:
        if kind == "psycopg-pool":
            pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False,
                                                    timeout=5, configure=configure)
            await pool.open()
            return pool
        conn = await psycopg.AsyncConnection.connect(dsn)
        await configure(conn)
        return conn

    source = await open_source()
    try:
        before = await state_async(kind, source, dsn)
        assert before["probe"][:2] == ("serializable", "on")

        async def body() -> None:
            async with pgcoord.exclusive(source, key, wait=mode != "busy") as conn:
                row = await (await conn.execute("select current_setting('transaction_isolation'),"
                                                " current_setting('transaction_read_only'),"
                                                " current_setting('transaction_deferrable')")).fetchone()
                assert row == ("serializable", "on", "on")
                if mode == "body-error":
                    raise Boom2

        if mode in ("busy", "cancel-wait"):
            other.conn.execute("select pg_advisory_xact_lock(%s)", (pgcoord.lock_key(key),))
        if mode == "cancel-wait":
            task = asyncio.create_task(body())
            await _wait_until(lambda: _waiting_on(dsn, pgcoord.lock_key(key)), "the lock is awaited")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif mode == "busy":
            with pytest.raises(pgcoord.LockBusy):
                await body()
        elif mode == "body-error":
            with pytest.raises(Boom2):
                await body()
        else:
            await body()
        other.conn.rollback()
        if mode == "cancel-wait" and GUARD_CANCEL:  # see the test above
            await _wait_until(lambda: _key_free(dsn, key), "the abandoned wait is over")
            if kind == "psycopg-conn":
                assert source.closed
                return
        after = await state_async(kind, source, dsn)
        now, then = same_but_pid(after, before)
        assert now == then
        if not (mode == "cancel-wait" and GUARD_CANCEL):
            assert after["pid"] == before["pid"]
    finally:
        await source.close()
        other.close()
