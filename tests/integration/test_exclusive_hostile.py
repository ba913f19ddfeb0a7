"""exclusive() and run_statement() when their cleanup hangs.

Issue #11, item 3: a rollback or a give-back that does not finish must not hold
the caller past its bound, must not hand it a CancelledError it never asked for,
and must not return the connection dirty: past the bound the connection is cut
(so the server ends the session and its locks) and the caller gets its own
outcome. The bound is ``pgcoord._aio.CLEANUP_TIMEOUT``, lowered here to 0.5 s.

The hangs are real: a proxy that stops forwarding (the network goes silent while
the body's exception is being rolled back), an asyncpg connection whose reset
query sleeps on the server, a SQLAlchemy pool whose reset event does the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import psycopg
import pytest
from sqlalchemy import event

import pgcoord
from pgcoord._core import aio as _aio
from pgcoord._drivers import run_statement

from .conftest import advisory_locks, sql, unique
from .proxy import FreezableProxy
from .small_pools import ASYNC_KINDS, observe, open_async, open_sync, pid_of, state_async

BOUND = 0.5
SLACK = 2.0  # a loaded two-core machine; the unbounded cases take 30 s or forever


class Boom(Exception):
    pass


@pytest.fixture(autouse=True)
def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_aio, "CLEANUP_TIMEOUT", BOUND)


@pytest.fixture
def proxy(dsn: str) -> Iterator[FreezableProxy]:
    p = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]))
    try:
        yield p
    finally:
        p.close()


async def _pid(conn: Any) -> int:
    if hasattr(conn, "exec_driver_sql"):
        return pid_of((await conn.get_raw_connection()).driver_connection)
    return pid_of(conn)


async def _gone(dsn: str, pid: int, seconds: float = 15.0) -> None:
    """Until the server has ended backend ``pid`` (and so released its locks)."""
    for _ in range(int(seconds / 0.05)):
        if not sql(dsn, "select 1 from pg_stat_activity where pid = %s", pid):
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"backend {pid} still there after {seconds} s")


@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_a_rollback_on_a_silent_network_gives_the_caller_its_own_error_in_time(
    kind: str, dsn: str, proxy: FreezableProxy,
) -> None:
    key = unique("hostile")
    async with open_async(kind, proxy.dsn(dsn)) as source:
        pid: list[int] = []
        started = 0.0
        with pytest.raises(Boom):
            async with pgcoord.exclusive(source, key) as conn:
                pid.append(await _pid(conn))
                assert [k for p, k, _ in advisory_locks(dsn) if p == pid[0]] == [pgcoord.lock_key(key)]
                proxy.freeze()
                started = time.monotonic()
                raise Boom
        took = time.monotonic() - started
        assert took < BOUND + SLACK, f"the caller waited {took:.1f} s for a cleanup bounded at {BOUND} s"
        proxy.frozen.clear()
        # The connection was cut, not given back dirty: the server ends its session
        # (and releases the lock), and the source goes on with a new one.
        await _gone(dsn, pid[0])
        assert advisory_locks(dsn) == []
        if "conn" in kind:
            # A connection the caller passed in is closed: its state is unknown.
            # (The abandoned rollback finishes in the background: give it a moment.)
            await _wait_closed(source)
            return
        async with asyncio.timeout(20):
            state = await state_async(kind, source, proxy.dsn(dsn))
        assert state["pid"] != pid[0]
        assert state["after"] == ("idle", [])
        async with pgcoord.exclusive(source, key, wait=False):
            pass


async def _wait_closed(conn: Any) -> None:
    def closed() -> bool:
        if hasattr(conn, "invalidated"):
            return bool(conn.invalidated)
        if hasattr(conn, "is_closed"):
            return bool(conn.is_closed())
        return bool(conn.closed)

    for _ in range(100):
        if closed():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"{conn!r} is still open")


@pytest.mark.parametrize("kind", ASYNC_KINDS)
async def test_a_caller_cancelled_during_a_hung_rollback_gets_its_cancellation_in_time(
    kind: str, dsn: str, proxy: FreezableProxy,
) -> None:
    """The caller asked for this cancellation: it gets it, and only it, no later
    than the bound."""
    key = unique("hostile")
    async with open_async(kind, proxy.dsn(dsn)) as source:
        pid: list[int] = []
        inside = asyncio.Event()

        async def body() -> None:
            async with pgcoord.exclusive(source, key) as conn:
                pid.append(await _pid(conn))
                inside.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(body())
        await asyncio.wait_for(inside.wait(), 10)
        proxy.freeze()
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        took = time.monotonic() - started
        assert took < BOUND + SLACK, f"the cancelled caller waited {took:.1f} s"
        proxy.frozen.clear()
        await _gone(dsn, pid[0])
        assert advisory_locks(dsn) == []
        if "conn" in kind:
            await _wait_closed(source)


class SlowResetConnection(asyncpg.Connection):  # type: ignore[misc]
    """An asyncpg connection whose pool reset (run on every give-back) hangs on
    the server for 30 s. The name asyncpg calls differs by version."""

    def get_reset_query(self) -> str:
        return "SELECT pg_sleep(30);" + super().get_reset_query()

    def _get_reset_query(self) -> str:
        return "SELECT pg_sleep(30);" + super()._get_reset_query()


def _slow_sa_reset(engine: Any) -> None:
    """SQLAlchemy runs a pool's reset event on every give-back; this one waits 30 s on the server."""
    pool = getattr(engine, "sync_engine", engine).pool

    @event.listens_for(pool, "reset", named=True)
    def reset(**kw: Any) -> None:
        cur = kw["dbapi_connection"].cursor()
        cur.execute("select pg_sleep(30)")
        cur.close()


@contextlib.asynccontextmanager
async def _slow_give_back(kind: str, dsn: str) -> AsyncIterator[Any]:
    """A source of one connection whose give-back hangs on the server."""
    if kind == "asyncpg-pool":
        async with open_async(kind, dsn, asyncpg_class=SlowResetConnection) as source:
            yield source
    else:
        async with open_async(kind, dsn) as source:
            _slow_sa_reset(source)
            yield source


@pytest.mark.parametrize("kind", ["asyncpg-pool", "sa-async-asyncpg", "sa-async-psycopg"])
@pytest.mark.parametrize("outcome", ["commit", "error"])
async def test_a_hung_give_back_returns_the_callers_outcome_in_time(
    kind: str, outcome: str, dsn: str, table: str,
) -> None:
    key = unique("hostile")
    async with _slow_give_back(kind, dsn) as source:
        pid: list[int] = []
        started = 0.0

        async def body() -> None:
            nonlocal started
            async with pgcoord.exclusive(source, key) as conn:
                pid.append(await _pid(conn))
                await _exec(conn, f"insert into {table} values (1)")
                started = time.monotonic()
                if outcome == "error":
                    raise Boom

        if outcome == "error":
            with pytest.raises(Boom):
                await body()
        else:
            await body()
        took = time.monotonic() - started
        assert took < BOUND + SLACK, f"the caller waited {took:.1f} s for a give-back bounded at {BOUND} s"
        assert sql(dsn, f"select count(*) from {table}") == [(1 if outcome == "commit" else 0,)]
        # The backend may still sleep in the reset it was given (until it next
        # writes to its closed socket), but it holds nothing and no transaction.
        assert observe(dsn, pid[0]) in ((None, []), ("active", []))
        assert advisory_locks(dsn) == []
        # The pool's one slot is free again: a new connection, used normally.
        async with asyncio.timeout(20), pgcoord.exclusive(source, key, wait=False) as conn:
            assert await _pid(conn) != pid[0]
            started = time.monotonic()
        assert time.monotonic() - started < BOUND + SLACK


@pytest.mark.parametrize("kind", ["asyncpg-pool", "sa-async-asyncpg", "sa-async-psycopg"])
async def test_run_statement_returns_its_row_when_the_give_back_hangs(kind: str, dsn: str) -> None:
    async with _slow_give_back(kind, dsn) as source:
        started = time.monotonic()
        row = await run_statement(source, "select pg_backend_pid(), cast($1 as int)", (7,))
        took = time.monotonic() - started
        assert row is not None and row[1] == 7
        assert took < BOUND + SLACK, f"run_statement waited {took:.1f} s for its give-back"
        assert observe(dsn, int(row[0])) in ((None, []), ("active", []))
        async with asyncio.timeout(20):
            again = await run_statement(source, "select pg_backend_pid()", ())
        assert again is not None and again[0] != row[0]


@pytest.fixture
def table(dsn: str) -> str:
    name = unique("hostile_t").replace(":", "_")
    sql(dsn, f"create table {name} (id int)")
    return name


async def _exec(conn: Any, statement: str) -> None:
    if hasattr(conn, "exec_driver_sql"):
        await conn.exec_driver_sql(statement)
    else:
        await conn.execute(statement)


# -- sync sources: a watchdog thread cuts the socket past the bound ---------------

SYNC_KINDS = ["psycopg-sync-pool", "psycopg-sync-conn", "sa-sync-engine", "sa-sync-conn"]


@pytest.mark.parametrize("kind", SYNC_KINDS)
async def test_a_sync_rollback_on_a_silent_network_gives_the_caller_its_own_error_in_time(
    kind: str, dsn: str, proxy: FreezableProxy,
) -> None:
    """Run in a thread so that the test's event loop (and the proxy) go on."""
    key = unique("hostile")

    def run() -> tuple[float, int, Any]:
        with open_sync(kind, proxy.dsn(dsn)) as source:
            pid = 0
            started = 0.0
            with pytest.raises(Boom), pgcoord.exclusive(source, key) as conn:
                pid = _spid(conn)
                proxy.freeze()
                started = time.monotonic()
                raise Boom
            took = time.monotonic() - started
            proxy.frozen.clear()
            for _ in range(300):  # until the server has ended the cut session
                if not sql(dsn, "select 1 from pg_stat_activity where pid = %s", pid):
                    break
                time.sleep(0.05)
            after = None
            if "conn" not in kind:  # the pool goes on with a new connection
                with pgcoord.exclusive(source, key, wait=False) as conn:
                    after = _spid(conn)
            else:
                after = _sync_closed(source)
            return took, pid, after

    took, pid, after = await asyncio.to_thread(run)
    assert took < BOUND + SLACK, f"the caller waited {took:.1f} s for a cleanup bounded at {BOUND} s"
    await _gone(dsn, pid)
    assert advisory_locks(dsn) == []
    if "conn" in kind:
        assert after is True, "the connection the caller passed in was closed"
    else:
        assert after != pid


def _spid(conn: Any) -> int:
    if hasattr(conn, "exec_driver_sql"):
        return int(conn.exec_driver_sql("select pg_backend_pid()").scalar_one())
    return int(conn.info.backend_pid)


def _sync_closed(conn: Any) -> bool:
    if hasattr(conn, "invalidated"):
        return bool(conn.invalidated)
    return bool(conn.closed)


# -- a pooled connection the server ended while it sat in its pool ------------------


def _terminate(dsn: str, pid: int) -> None:
    assert sql(dsn, "select pg_terminate_backend(%s)", pid) == [(True,)]


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("kind", [k for k in ASYNC_KINDS if "conn" not in k])
async def test_a_dead_pooled_connection_is_replaced_not_raised(kind: str, named: bool, dsn: str) -> None:
    """pg_terminate_backend (or a restart) ends an idle pooled connection; the
    pool finds out at its next statement. exclusive() has then run nothing and
    holds nothing, so it takes the lock on another connection instead of handing
    the caller the driver's error."""
    async with open_async(kind, dsn) as source:
        async with pgcoord.exclusive(source, 11) as conn:
            pid = await _pid(conn)
        _terminate(dsn, pid)
        await asyncio.sleep(0.2)
        key = unique("dead") if named else 11
        async with asyncio.timeout(20), pgcoord.exclusive(source, key) as conn:
            await _exec(conn, "select 1")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        if named:
            assert sql(dsn, "select name from pgcoord.lock_names where key = %s",
                       pgcoord.lock_key(key)) == [(key,)]
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ["psycopg-sync-pool", "sa-sync-engine"])
def test_a_dead_pooled_sync_connection_is_replaced_not_raised(kind: str, dsn: str) -> None:
    with open_sync(kind, dsn) as source:
        with pgcoord.exclusive(source, 12) as conn:
            pid = _spid(conn)
        _terminate(dsn, pid)
        time.sleep(0.2)
        with pgcoord.exclusive(source, 12) as conn:
            _spid(conn)
            assert [k for _, k, _ in advisory_locks(dsn)] == [12]
    assert advisory_locks(dsn) == []


# -- a cancellation on a silent network must not stop the event loop ---------------


@pytest.mark.parametrize("what", ["exclusive", "statement"])
def test_cancelling_a_psycopg_statement_on_a_silent_network_does_not_stop_the_loop(
    what: str, dsn: str, proxy: FreezableProxy,
) -> None:
    """psycopg before 3.2 answers a cancelled statement with libpq's blocking
    cancel request, on the event loop's thread: over a network that does not
    answer, the whole process stops for good. A lock wait someone cancels (an
    asyncio.timeout around exclusive()) or a statement of Lease/Scheduler must
    instead close its connection and let the caller go on."""
    import subprocess
    import sys

    key = unique("silent")
    with psycopg.connect(dsn) as blocker:
        blocker.execute("select pg_advisory_xact_lock(%s)", (pgcoord.lock_key(key),))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.cancel_on_silent_network",
             proxy.dsn(dsn), key, what],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "waiting"
            proxy.freeze()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("the cancelled statement stopped the process's event loop")
        finally:
            proxy.frozen.clear()
    took = float(out.split()[-1])
    assert took < 12, f"the cancellation took {took} s"
