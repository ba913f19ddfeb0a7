"""A psycopg connection the caller has put in pipeline mode.

There a statement is only queued until something syncs the pipeline. pgcoord's
own statements on such a connection must still be answered before pgcoord
returns: the lock held when the body starts, a busy lock refused as LockBusy at
the ``with``, a stale fence refused as StaleFence at ``check_fence`` (not as a
psycopg error at some later statement of the caller's, after the body ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

import psycopg
import pytest

import pgcoord

from .conftest import advisory_locks, semaphore_held_in_a_thread, sql, unique

IDLE = psycopg.pq.TransactionStatus.IDLE


@pytest.fixture
def table(dsn: str) -> str:
    name = unique("t").replace(":", "_")
    sql(dsn, f"create table {name} (id int)")
    return name


def _lease_at_fence(dsn: str, fence: int) -> str:
    name = unique("pipeline-fence")
    sql(dsn, "insert into pgcoord.leases (name, holder, fence, expires_at)"
             " values (%s, 'someone', %s, now() + interval '1 hour')", name, fence)
    return name


def test_sync_exclusive_holds_the_lock_when_the_body_starts(dsn: str, locks_in: None) -> None:
    key = unique("pipeline")
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with pgcoord.exclusive(conn, key):
            # No statement of the body yet: nothing else would sync the pipeline.
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert advisory_locks(dsn) == []
        assert conn.info.transaction_status == IDLE


async def test_async_exclusive_holds_the_lock_when_the_body_starts(dsn: str, locks_in: None) -> None:
    key = unique("pipeline")
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        async with pgcoord.exclusive(conn, key):
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert advisory_locks(dsn) == []
        assert conn.info.transaction_status == IDLE


def test_sync_busy_lock_is_lockbusy_before_the_body(dsn: str, locks_in: None) -> None:
    key = unique("pipeline")
    ran = []
    with psycopg.connect(dsn) as holder, pgcoord.exclusive(holder, key), \
            psycopg.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.LockBusy), pgcoord.exclusive(conn, key, wait=False):
            ran.append(True)
        assert ran == []
        assert conn.info.transaction_status == IDLE
        assert conn.execute("select 7").fetchone() == (7,)
        conn.commit()


async def test_async_busy_lock_is_lockbusy_before_the_body(dsn: str, locks_in: None) -> None:
    key = unique("pipeline")
    ran = []
    async with await psycopg.AsyncConnection.connect(dsn) as holder, pgcoord.exclusive(holder, key), \
            await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.LockBusy):
            async with pgcoord.exclusive(conn, key, wait=False):
                ran.append(True)
        assert ran == []
        assert conn.info.transaction_status == IDLE


async def test_a_lock_in_the_callers_transaction_is_refused_and_the_transaction_goes_on(
    dsn: str, table: str, locks_in: None,
) -> None:
    """In the caller's own transaction the lock is taken in a savepoint: a busy
    one is LockBusy at the ``with``, and the caller's writes before and after
    commit."""
    key = unique("pipeline")
    async with await psycopg.AsyncConnection.connect(dsn) as holder, pgcoord.exclusive(holder, key), \
            await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline(), conn.transaction():
        await conn.execute(f"insert into {table} values (1)")
        with pytest.raises(pgcoord.LockBusy):
            async with pgcoord.exclusive(conn, key, wait=False):
                pass
        await conn.execute(f"insert into {table} values (2)")
    assert sql(dsn, f"select count(*) from {table}") == [(2,)]


def test_sync_lock_in_the_callers_transaction_is_refused_and_the_transaction_goes_on(
    dsn: str, table: str, locks_in: None,
) -> None:
    key = unique("pipeline")
    with psycopg.connect(dsn) as holder, pgcoord.exclusive(holder, key), \
            psycopg.connect(dsn) as conn, conn.pipeline(), conn.transaction():
        conn.execute(f"insert into {table} values (1)")
        with pytest.raises(pgcoord.LockBusy), pgcoord.exclusive(conn, key, wait=False):
            pass
        conn.execute(f"insert into {table} values (2)")
    assert sql(dsn, f"select count(*) from {table}") == [(2,)]


async def test_a_full_semaphore_is_lockbusy_and_a_release_wakes_nobody_in_error(
    dsn: str, locks_in: None, caplog: pytest.LogCaptureFixture,
) -> None:
    name = unique("pipeline-sem")
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        with caplog.at_level(logging.WARNING, logger="pgcoord"):
            async with pgcoord.semaphore(conn, name, limit=1):
                assert len(advisory_locks(dsn)) == 1
        assert [r.getMessage() for r in caplog.records] == []
        async with await psycopg.AsyncConnection.connect(dsn) as other, \
                pgcoord.semaphore(other, name, limit=1):
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(conn, name, limit=1, wait=False):
                    pass
        assert conn.info.transaction_status == IDLE


async def test_a_semaphore_waiter_in_pipeline_mode_gets_the_slot_on_release(
    dsn: str, locks_in: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only the release's wake can hand the slot over within the test's bound.
    monkeypatch.setattr(pgcoord.locks.semaphores, "SEMAPHORE_RECHECK", 60.0)
    name = unique("pipeline-sem")
    got = asyncio.Event()

    async def waiter() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline(), \
                pgcoord.semaphore(conn, name, limit=1, timeout=20):
            got.set()

    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        async with pgcoord.semaphore(holder, name, limit=1):
            task = asyncio.create_task(waiter())
            await asyncio.sleep(0.5)
            assert not got.is_set() and not task.done()
        await asyncio.wait_for(task, 10)
    assert got.is_set()


def test_sync_semaphore_waiter_in_pipeline_mode_gets_the_slot_on_release(
    dsn: str, locks_in: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pgcoord.locks.semaphores, "SEMAPHORE_RECHECK", 60.0)  # as above
    name = unique("pipeline-sem")
    with semaphore_held_in_a_thread(dsn, name) as release:
        threading.Timer(0.5, release.set).start()
        with psycopg.connect(dsn) as conn, conn.pipeline():
            with pgcoord.semaphore(conn, name, limit=1, timeout=20):
                assert release.is_set(), "the slot was given while the holder still had it"
            assert conn.info.transaction_status == IDLE


def test_sync_stale_fence_is_stalefence_at_the_call(dsn: str) -> None:
    name = _lease_at_fence(dsn, 5)
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.StaleFence):
            pgcoord.check_fence(conn, name, 3)
        conn.rollback()
        pgcoord.check_fence(conn, name, 5)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        conn.rollback()


async def test_async_stale_fence_is_stalefence_at_the_call(dsn: str) -> None:
    name = _lease_at_fence(dsn, 5)
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.StaleFence):
            await pgcoord.check_fence(conn, name, 3)
        await conn.rollback()
        await pgcoord.check_fence(conn, name, 5)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        await conn.rollback()


def _try_elsewhere(dsn: str, key: str) -> bool:
    """Whether another session can take ``key`` now."""
    with psycopg.connect(dsn, autocommit=True) as other:
        row = other.execute("select pg_try_advisory_lock(%s)", (pgcoord.lock_key(key),)).fetchone()
        other.execute("select pg_advisory_unlock_all()")
        return bool(row and row[0])


def test_a_statement_the_caller_queued_before_does_not_cost_the_lock(dsn: str, locks_in: None) -> None:
    """libpq reads ACTIVE while a queued statement is unanswered: taken for the
    caller's transaction, the lock went into psycopg's implicit one and was gone
    when the body started."""
    key = unique("pipeline")
    with psycopg.connect(dsn, autocommit=True) as conn, conn.pipeline():
        conn.execute("select 1")
        with pgcoord.exclusive(conn, key):
            assert not _try_elsewhere(dsn, key)
        assert conn.info.transaction_status == IDLE


async def test_async_a_statement_queued_before_does_not_cost_the_lock_or_the_slot(
    dsn: str, locks_in: None,
) -> None:
    key, name = unique("pipeline"), unique("pipeline-sem")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn, conn.pipeline():
        await conn.execute("select 1")
        async with pgcoord.exclusive(conn, key):
            assert not _try_elsewhere(dsn, key)
        await conn.execute("select 1")
        async with pgcoord.semaphore(conn, name, limit=1), \
                await psycopg.AsyncConnection.connect(dsn) as other:
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(other, name, limit=1, wait=False):
                    pass


@pytest.mark.parametrize("ending", ["sql commit", "sql rollback", "conn.commit()"])
def test_a_body_that_ends_the_transaction_is_told_so(dsn: str, ending: str, locks_in: None) -> None:
    key = unique("pipeline")
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.PgcoordError, match="ended inside the block"), \
                pgcoord.exclusive(conn, key):
            if ending == "conn.commit()":
                conn.commit()
            else:
                conn.execute(ending.removeprefix("sql "))
        assert conn.info.transaction_status == IDLE


async def test_async_a_body_that_commits_with_sql_is_told_so(dsn: str, locks_in: None) -> None:
    key = unique("pipeline")
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(pgcoord.PgcoordError, match="ended inside the block"):
            async with pgcoord.exclusive(conn, key):
                await conn.execute("commit")
        assert conn.info.transaction_status == IDLE


def test_a_failed_statement_the_body_queued_leaves_the_connection_usable(
    dsn: str, table: str, locks_in: None,
) -> None:
    key = unique("pipeline")
    sql(dsn, f"alter table {table} add primary key (id)")
    sql(dsn, f"insert into {table} values (1)")
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with pytest.raises(Boom), pgcoord.exclusive(conn, key):
            conn.execute(f"insert into {table} values (1)")  # fails, unanswered yet
            raise Boom
        assert not conn.closed
        assert conn.info.transaction_status == IDLE
        assert conn.execute("select 7").fetchone() == (7,)
        conn.commit()


@pytest.mark.parametrize("joined", [False, True])
async def test_statement_timeout_does_not_cut_a_wait_in_pipeline_mode(
    dsn: str, joined: bool, locks_in: None,
) -> None:
    """As outside pipeline mode: the wait is bounded by ``timeout`` alone, and
    the connection's statement_timeout is in force again afterwards."""
    key = unique("pipeline")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as holder, \
            pgcoord.exclusive(holder, key), \
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("set statement_timeout = 300")
        async with conn.pipeline():
            started = asyncio.get_running_loop().time()
            with pytest.raises(pgcoord.LockTimeout):
                if joined:
                    async with conn.transaction(), pgcoord.exclusive(conn, key, timeout=1.0):
                        pass
                else:
                    async with pgcoord.exclusive(conn, key, timeout=1.0):
                        pass
            assert asyncio.get_running_loop().time() - started >= 0.9
            cur = await conn.execute("show statement_timeout")
            assert await cur.fetchone() == ("300ms",)


class Boom(Exception):
    pass


def test_a_transaction_block_the_caller_just_opened_is_joined(dsn: str, locks_in: None) -> None:
    """psycopg queues the BEGIN of ``conn.transaction()`` without sending it: libpq
    still reads IDLE. The lock must join that transaction, and last as long."""
    key = unique("pipeline")
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with conn.transaction():
            with pgcoord.exclusive(conn, key):
                pass
            assert not _try_elsewhere(dsn, key), "the lock ended before the caller's transaction"
        assert _try_elsewhere(dsn, key)
        assert conn.info.transaction_status == IDLE


@pytest.mark.parametrize("feature", ["exclusive", "semaphore"])
async def test_a_cancellation_anywhere_in_the_entry_leaves_autocommit_as_it_was(
    dsn: str, feature: str, locks_in: None,
) -> None:
    """In pipeline mode psycopg syncs to switch autocommit: a round trip, which a
    cancellation can land in after the switch. Swept over the entry's moments,
    through a network with 20 ms of latency each way."""
    from .proxy import FreezableProxy

    name = unique("pipeline-cancel")
    proxy = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]), latency=0.02)
    try:
        for ms in range(0, 260, 13):
            conn = await psycopg.AsyncConnection.connect(proxy.dsn(dsn))
            try:
                async def enter(conn: psycopg.AsyncConnection[Any] = conn) -> None:
                    async with conn.pipeline():
                        lock = (pgcoord.semaphore(conn, name, limit=1) if feature == "semaphore"
                                else pgcoord.exclusive(conn, name))
                        async with lock:
                            await asyncio.sleep(0.05)

                task = asyncio.create_task(enter())
                await asyncio.sleep(ms / 1000)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if not conn.closed:
                    assert conn.autocommit is False, f"autocommit left on by a cancel at {ms} ms"
                    assert conn.info.transaction_status == IDLE
            finally:
                await conn.close()
            assert advisory_locks(dsn) == []
    finally:
        proxy.close()
