"""Semaphores (docs/semaphores.md): at most ``limit`` holders across processes, in both
scopes; waiting is event-driven; every connection goes back clean."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.holder.semaphore
import pgcoord.locks.semaphores
from pgcoord.keys import semaphore_key

from .conftest import sql, unique
from .sources import ASYNC_CONNS, ASYNC_POOLS, SYNC_CONNS, SYNC_POOLS, apid, open_async, open_sync

REPLICA = str(Path(__file__).with_name("semaphore_replica.py"))


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, REPLICA, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _lanes(dsn: str, name: str) -> list[tuple[int, int, bool]]:
    """(pid, lane, granted) of every semaphore row of ``name`` in pgcoord.holders."""
    return [(int(r[0]), -1 if r[1] is None else int(r[1]), bool(r[2])) for r in sql(
        dsn, "select pid, lane, granted from pgcoord.holders where kind = 'semaphore'"
             " and name = %s order by pid", name)]


def _semaphore_locks(dsn: str, name: str) -> int:
    """Advisory locks (lanes and waiting room) of semaphore ``name`` held by anyone."""
    rows = sql(dsn, "select count(*) from pg_locks where locktype = 'advisory' and objsubid = 2"
                    " and classid = (%s::bigint & 4294967295)::oid", semaphore_key(name))
    return int(rows[0][0])  # type: ignore[call-overload]


async def _wait_until(check: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.fixture
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters in this process retry only when notified: a wake-up proves the
    notification, not the crash-path recheck."""
    monkeypatch.setattr(pgcoord.locks.semaphores, "SEMAPHORE_RECHECK", 60.0)
    monkeypatch.setattr(pgcoord.holder.semaphore, "SEMAPHORE_RECHECK", 60.0)


# -- keys and arguments -------------------------------------------------------------

def test_semaphore_key_is_the_sql_function(dsn: str) -> None:
    names = ["partner-api", "", "ünïcödé ☃", "x" * 300, "a/b:c"]
    rows = sql(dsn, "select n, pgcoord.semaphore_key(n) from unnest(%s::text[]) as n", names)
    assert {str(n): int(k) for n, k in rows} == {n: semaphore_key(n) for n in names}  # type: ignore[call-overload]
    assert all(-(2**31) <= semaphore_key(n) < 2**31 for n in names)
    assert semaphore_key("partner-api") == pgcoord.lock_key("partner-api") >> 32


@pytest.mark.parametrize(("args", "error"), [
    ((42, {"limit": 1}), TypeError),
    (("", {"limit": 1}), ValueError),
    (("n", {"limit": 0}), ValueError),
    (("n", {"limit": True}), TypeError),
    (("n", {"limit": 1.5}), TypeError),
    (("n", {"limit": 10**6}), ValueError),
    (("n", {"limit": 2, "timeout": -1}), ValueError),
    (("n", {"limit": 2, "timeout": "1"}), TypeError),
    (("n", {"limit": 2, "wait": False, "timeout": 1}), ValueError),
    (("n", {"limit": 2, "wait": 1}), TypeError),
])
async def test_bad_arguments_are_refused_at_the_call(dsn: str, args: Any, error: type) -> None:
    name, kwargs = args
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        with pytest.raises(error):
            pgcoord.semaphore(pool, name, **kwargs)
        async with pgcoord.LockHolder(dsn) as holder:
            with pytest.raises(error):
                holder.semaphore(name, **kwargs)
    finally:
        await pool.close()


def test_limit_is_required_and_sources_are_checked(dsn: str) -> None:
    with pytest.raises(TypeError):
        pgcoord.semaphore(object(), "n")  # type: ignore[call-arg]
    with pytest.raises(pgcoord.UnsupportedConnection):
        pgcoord.semaphore(object(), "n", limit=1)


# -- at most `limit`, across processes ---------------------------------------------

@pytest.mark.parametrize("scope", ["xact", "joined", "pooler", "session"])
def test_never_more_than_limit_holders_across_processes(dsn: str, scope: str) -> None:
    """50 tasks in 3 processes, limit 5: the count of holders reaches 5, never 6;
    in every way of waiting (notified, polling in the caller's transaction,
    retrying behind a transaction-mode pooler, session scope)."""
    from .pgbouncer import PgBouncer

    name, table = unique("sem-count"), f"sem_count_{unique('t').split(':')[1]}"
    sql(dsn, f"create table {table} (cur int not null, peak int not null)")
    sql(dsn, f"insert into {table} values (0, 0)")
    bouncer = None
    source = dsn
    if scope == "pooler":
        bouncer = PgBouncer(int(dsn.rsplit(":", 1)[1].split("/")[0]),
                            extra="server_round_robin = 1\ndefault_pool_size = 12\n")
        source = bouncer.dsn(dsn)
    procs = [_spawn(source, name, "5", scope, "count", table, str(n)) for n in (17, 17, 16)]
    try:
        outputs = [proc.communicate(timeout=90)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        if bouncer is not None:
            bouncer.stop()
    assert all("DONE" in out for out in outputs), outputs
    assert sql(dsn, f"select cur, peak from {table}") == [(0, 5)]
    assert _semaphore_locks(dsn, name) == 0


@pytest.mark.parametrize("scope", ["xact", "session"])
async def test_a_killed_holders_slot_goes_to_a_waiter(dsn: str, scope: str) -> None:
    name = unique("sem-crash")
    proc = _spawn(dsn, name, "1", scope, "hold")
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.strip() == "HOLDING"
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(pool, name, limit=1, wait=False):
                    pass
            waiter = asyncio.create_task(_hold_once(pool, name))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(waiter, 5)
            assert time.monotonic() - killed < 5
        finally:
            await pool.close()
    finally:
        proc.kill()
        proc.wait()
    assert _semaphore_locks(dsn, name) == 0


async def _hold_once(source: Any, name: str) -> None:
    async with pgcoord.semaphore(source, name, limit=1, timeout=30) as conn:
        await conn.execute("select 1")


# -- busy, timeout, waking ---------------------------------------------------------

async def test_busy_and_timeout(dsn: str) -> None:
    name = unique("sem-busy")
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=3)
    try:
        async with pgcoord.semaphore(pool, name, limit=2), pgcoord.semaphore(pool, name, limit=2):
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(pool, name, limit=2, wait=False):
                    pass
            with pytest.raises(pgcoord.LockTimeout):
                async with pgcoord.semaphore(pool, name, limit=2, timeout=0):
                    pass
            started = time.monotonic()
            with pytest.raises(pgcoord.LockTimeout):
                async with pgcoord.semaphore(pool, name, limit=2, timeout=0.3):
                    pass
            assert 0.3 <= time.monotonic() - started < 3
        # both released at commit: two more fit at once
        async with pgcoord.semaphore(pool, name, limit=2, wait=False), \
                pgcoord.semaphore(pool, name, limit=2, wait=False):
            pass
    finally:
        await pool.close()
    assert _semaphore_locks(dsn, name) == 0


@pytest.mark.usefixtures("no_recheck")
@pytest.mark.parametrize("ending", ["commit", "exception"])
async def test_a_release_wakes_a_waiter_by_notification(dsn: str, ending: str) -> None:
    """With the periodic recheck pushed to 60 s, only the release's NOTIFY can
    wake the waiter: after a commit, and after pgcoord's own rollback."""
    name = unique("sem-wake")
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
    try:
        release = asyncio.Event()

        async def holder() -> None:
            async with pgcoord.semaphore(pool, name, limit=1):
                await release.wait()
                if ending == "exception":
                    raise RuntimeError("body failed")

        held = asyncio.create_task(holder())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
        waiter = asyncio.create_task(_hold_once(pool, name))
        await _wait_until(lambda: any(not granted for _, _, granted in _lanes(dsn, name)))
        release.set()
        await asyncio.wait_for(waiter, 5)
        if ending == "exception":
            with pytest.raises(RuntimeError):
                await held
    finally:
        await pool.close()


# -- every source, and what goes back to it ----------------------------------------

async def _assert_clean_async(conn: Any) -> None:
    """No LISTEN, no advisory lock, no transaction on this connection."""
    if hasattr(conn, "exec_driver_sql"):  # SQLAlchemy
        listening = (await conn.exec_driver_sql("select count(*) from pg_listening_channels()")).scalar()
        locks = (await conn.exec_driver_sql(
            "select count(*) from pg_locks where locktype = 'advisory'"
            " and pid = pg_backend_pid()")).scalar()
        await conn.rollback()
    elif hasattr(conn, "fetchval"):  # asyncpg
        assert not conn.is_in_transaction()
        listening = await conn.fetchval("select count(*) from pg_listening_channels()")
        locks = await conn.fetchval("select count(*) from pg_locks where locktype = 'advisory'"
                                    " and pid = pg_backend_pid()")
    else:  # psycopg
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        autocommit = conn.autocommit
        listening = (await (await conn.execute(
            "select count(*) from pg_listening_channels()")).fetchone())[0]
        locks = (await (await conn.execute(
            "select count(*) from pg_locks where locktype = 'advisory'"
            " and pid = pg_backend_pid()")).fetchone())[0]
        if not autocommit:
            await conn.rollback()
    assert (listening, locks) == (0, 0)


def _checked_out(kind: str, source: Any) -> Any:
    """A context manager yielding the connection a size-1 pool gave the semaphore,
    or the connection itself."""
    import contextlib

    if kind == "asyncpg-pool":
        return source.acquire()
    if kind == "psycopg-pool":
        return source.connection()
    if kind in ("sa-async-asyncpg", "sa-async-psycopg"):
        return source.connect()

    @contextlib.asynccontextmanager
    async def same() -> Any:
        yield source

    return same()


async def _autocommit_async(kind: str, source: Any) -> bool | None:
    """The driver's autocommit setting of the connection a source gives (asyncpg
    has none): a wait switches it for its statements and must put it back."""
    async with _checked_out(kind, source) as conn:
        if hasattr(conn, "get_raw_connection"):  # SQLAlchemy
            driver = (await conn.get_raw_connection()).driver_connection
            await conn.rollback()
        else:
            driver = conn
        return getattr(driver, "autocommit", None)  # type: ignore[no-any-return]


@pytest.mark.usefixtures("no_recheck")
@pytest.mark.parametrize("kind", ASYNC_POOLS + ASYNC_CONNS)
async def test_every_async_source_waits_and_goes_back_clean(dsn: str, kind: str) -> None:
    """With the recheck pushed to 60 s, each waiter is woken by the notification."""
    name = unique(f"sem-src-{kind}")
    blocker = await asyncpg.connect(dsn)
    async with open_async(kind, dsn, size=1) as source:
        autocommit_before = await _autocommit_async(kind, source)
        release = asyncio.Event()

        async def hold() -> None:
            async with pgcoord.semaphore(blocker, name, limit=1):
                await release.wait()

        held = asyncio.create_task(hold())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
        got: list[int] = []

        async def wait() -> None:
            async with pgcoord.semaphore(source, name, limit=1, timeout=20) as conn:
                got.append(await apid(conn))
                assert (got[0], 0, True) in _lanes(dsn, name)

        waiter = asyncio.create_task(wait())
        # the waiter shows as one, not granted
        await _wait_until(lambda: [g for _, _, g in _lanes(dsn, name)] == [True, False]
                          or [g for _, _, g in _lanes(dsn, name)] == [False, True])
        # with no known start of its wait (each retry is a new statement): NULL,
        # never a time that keeps moving
        assert sql(dsn, "select granted, since is null from pgcoord.holders"
                        " where kind = 'semaphore' and name = %s order by granted",
                   name) == [(False, True), (True, False)]
        release.set()
        await asyncio.wait_for(asyncio.gather(held, waiter), 10)
        assert got
        async with _checked_out(kind, source) as conn:
            await _assert_clean_async(conn)
        assert await _autocommit_async(kind, source) == autocommit_before
    await blocker.close()
    assert _semaphore_locks(dsn, name) == 0


def _assert_clean_sync(conn: Any) -> None:
    if hasattr(conn, "exec_driver_sql"):
        listening = conn.exec_driver_sql("select count(*) from pg_listening_channels()").scalar()
        locks = conn.exec_driver_sql("select count(*) from pg_locks where locktype = 'advisory'"
                                     " and pid = pg_backend_pid()").scalar()
        conn.rollback()
    else:
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        listening = conn.execute("select count(*) from pg_listening_channels()").fetchone()[0]
        locks = conn.execute("select count(*) from pg_locks where locktype = 'advisory'"
                             " and pid = pg_backend_pid()").fetchone()[0]
        conn.rollback()
    assert (listening, locks) == (0, 0)


def _autocommit_sync(kind: str, source: Any) -> bool | None:
    if kind == "psycopg-sync-pool":
        with source.connection() as conn:
            return conn.autocommit  # type: ignore[no-any-return]
    if kind == "sa-sync-engine":
        with source.connect() as conn:
            return conn.connection.driver_connection.autocommit  # type: ignore[no-any-return]
    if kind == "sa-sync-conn":
        found = source.connection.driver_connection.autocommit
        source.rollback()
        return found  # type: ignore[no-any-return]
    return source.autocommit  # type: ignore[no-any-return]


@pytest.mark.usefixtures("no_recheck")
@pytest.mark.parametrize("kind", SYNC_POOLS + SYNC_CONNS)
def test_every_sync_source_waits_and_goes_back_clean(dsn: str, kind: str) -> None:
    """With the recheck pushed to 60 s, each waiter is woken by the notification."""
    name = unique(f"sem-sync-{kind}")
    with psycopg.connect(dsn) as blocker, open_sync(kind, dsn, size=1) as source:
        autocommit_before = _autocommit_sync(kind, source)
        release = threading.Event()
        errors: list[BaseException] = []

        def hold() -> None:
            with pgcoord.semaphore(blocker, name, limit=1):
                release.wait(20)

        def wait() -> None:
            try:
                with pgcoord.semaphore(source, name, limit=1, timeout=20) as conn:
                    if hasattr(conn, "exec_driver_sql"):
                        conn_pid = conn.exec_driver_sql("select pg_backend_pid()").scalar()
                    else:
                        conn_pid = conn.info.backend_pid
                    assert _lanes(dsn, name) == [(conn_pid, 0, True)]
            except BaseException as exc:  # reported below
                errors.append(exc)

        holder = threading.Thread(target=hold)
        holder.start()
        deadline = time.monotonic() + 5
        while _semaphore_locks(dsn, name) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiter = threading.Thread(target=wait)
        waiter.start()
        while sorted(g for _, _, g in _lanes(dsn, name)) != [False, True]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        holder.join(10)
        waiter.join(10)
        assert not errors, errors
        if kind == "psycopg-sync-pool":
            with source.connection() as conn:
                _assert_clean_sync(conn)
        elif kind == "sa-sync-engine":
            with source.connect() as conn:
                _assert_clean_sync(conn)
        else:
            _assert_clean_sync(source)
        assert _autocommit_sync(kind, source) == autocommit_before
    assert _semaphore_locks(dsn, name) == 0


@pytest.mark.parametrize("kind", ["asyncpg-conn", "psycopg-conn", "sa-async-psycopg"])
@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_giving_up_a_wait_leaves_nothing_behind(dsn: str, kind: str, how: str) -> None:
    name = unique("sem-giveup")
    blocker = await asyncpg.connect(dsn)
    async with open_async(kind, dsn, size=1) as source:
        async with pgcoord.semaphore(blocker, name, limit=1):
            if how == "cancel":
                waiter = asyncio.create_task(_hold_once(source, name))
                await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
                waiter.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter
            else:
                with pytest.raises(pgcoord.LockTimeout):
                    async with pgcoord.semaphore(source, name, limit=1, timeout=0.3):
                        pass
            assert [g for _, _, g in _lanes(dsn, name)] == [True]  # the waiter is gone
        async with _checked_out(kind, source) as conn:
            await _assert_clean_async(conn)
    await blocker.close()
    assert _semaphore_locks(dsn, name) == 0


async def test_inside_the_callers_transaction(dsn: str) -> None:
    """Joined: the slot is the caller's transaction's; busy leaves it usable."""
    name = unique("sem-joined")
    conn = await asyncpg.connect(dsn)
    other = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            async with pgcoord.semaphore(conn, name, limit=1):
                pass
            assert _semaphore_locks(dsn, name) == 1  # held until the caller commits
            # the same transaction does not count its own lane twice
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(conn, name, limit=1, wait=False):
                    pass
            assert await conn.fetchval("select 1") == 1  # still usable
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.semaphore(other, name, limit=1, wait=False):
                    pass
        assert _semaphore_locks(dsn, name) == 0
    finally:
        await conn.close()
        await other.close()


# -- session scope -----------------------------------------------------------------

async def test_holder_semaphore_counts_lanes_of_its_own_session(dsn: str) -> None:
    """Session locks are re-entrant, yet one session never holds a lane twice:
    limit 2 admits two bodies through one holder, and a third waits."""
    name = unique("sem-holder")
    async with pgcoord.LockHolder(dsn) as holder:
        async with holder.semaphore(name, limit=2), holder.semaphore(name, limit=2):
            rows = _lanes(dsn, name)
            assert sorted(lane for _, lane, _ in rows) == [0, 1]
            assert {pid for pid, _, _ in rows} == {holder.backend_pid}
            with pytest.raises(pgcoord.LockBusy):
                async with holder.semaphore(name, limit=2, wait=False):
                    pass
            # this task holds both: a wait could only wait for itself
            with pytest.raises(pgcoord.PgcoordError, match="already holds"):
                async with holder.semaphore(name, limit=2, timeout=0.2):
                    pass

            async def third() -> None:  # another task waits (this one may release)
                async with holder.semaphore(name, limit=2, timeout=0.2):
                    pass

            with pytest.raises(pgcoord.LockTimeout):
                await asyncio.create_task(third())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0)


@pytest.mark.usefixtures("no_recheck")
async def test_holder_semaphore_waits_on_its_own_connection(dsn: str) -> None:
    name = unique("sem-holder-wait")
    async with pgcoord.LockHolder(dsn) as first, pgcoord.LockHolder(dsn) as second:
        release = asyncio.Event()

        async def hold() -> None:
            async with first.semaphore(name, limit=1):
                await release.wait()

        held = asyncio.create_task(hold())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
        entered = asyncio.Event()

        async def wait() -> None:
            async with second.semaphore(name, limit=1, timeout=20):
                rows = _lanes(dsn, name)
                assert len(rows) == 1 and rows[0][0] != second.backend_pid  # a waiting conn
                entered.set()

        waiter = asyncio.create_task(wait())
        await _wait_until(lambda: sorted(g for _, _, g in _lanes(dsn, name)) == [False, True])
        release.set()
        await asyncio.wait_for(asyncio.gather(held, waiter), 5)
        assert entered.is_set()
    assert _semaphore_locks(dsn, name) == 0


async def test_holder_semaphore_lost_with_its_session(dsn: str) -> None:
    name = unique("sem-lost")
    async with pgcoord.LockHolder(dsn, keepalive=1.0) as holder:
        started = asyncio.Event()

        async def body() -> None:
            async with holder.semaphore(name, limit=1):
                started.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(body())
        await started.wait()
        sql(dsn, "select pg_terminate_backend(%s)", holder.backend_pid)
        with pytest.raises(pgcoord.LockLost):
            await asyncio.wait_for(task, 5)
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0)
        async with holder.semaphore(name, limit=1, wait=False):  # reconnects
            assert len(_lanes(dsn, name)) == 1


async def test_holder_semaphore_on_a_member(dsn: str) -> None:
    name = unique("sem-member")
    async with pgcoord.Member(dsn, group=unique("g")) as member, \
            pgcoord.LockHolder(member) as one, pgcoord.LockHolder(member) as two, \
            one.semaphore(name, limit=2), two.semaphore(name, limit=2):
        rows = sql(dsn, "select member, lane from pgcoord.holders where kind = 'semaphore'"
                        " and name = %s order by lane", name)
        assert rows == [(member.name, 0), (member.name, 1)]
        with pytest.raises(pgcoord.LockBusy):
            async with one.semaphore(name, limit=2, wait=False):
                pass
    assert _semaphore_locks(dsn, name) == 0


def test_a_name_hashing_to_the_member_alive_namespace_moves_next_to_it(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one namespace that is Member's alive locks is never a semaphore's: a
    name whose hash lands there is moved to the value below, in Python and in SQL
    (no real name is known to land there, so the hash is replaced for the test)."""
    from pgcoord import keys as _keys

    alive = int(sql(dsn, "select pgcoord.member_alive_ns()")[0][0])  # type: ignore[call-overload]
    assert alive == _keys.MEMBER_ALIVE_NS
    monkeypatch.setattr(_keys, "_hash_name", lambda _name: (alive << 32) | 12345)
    assert _keys.semaphore_key.__wrapped__("any") == alive - 1
    monkeypatch.setattr(_keys, "_hash_name", lambda _name: ((alive + 1) << 32) | 12345)
    assert _keys.semaphore_key.__wrapped__("any") == alive + 1
    with psycopg.connect(dsn) as conn:  # a replaced lock_key, rolled back with the test
        conn.execute("create or replace function pgcoord.lock_key(name text) returns bigint"
                     " language sql immutable strict parallel safe"
                     f" return ({alive}::bigint << 32) | 12345")
        found = conn.execute("select pgcoord.semaphore_key('any')").fetchone()
        conn.rollback()
    assert found == (alive - 1,)


def test_member_alive_locks_keep_their_kind(dsn: str) -> None:
    """Only registered semaphore keys become kind 'semaphore' in the view."""

    async def run() -> list[tuple[Any, ...]]:
        async with pgcoord.Member(dsn, group=unique("g")) as member:
            return sql(dsn, "select h.kind from pgcoord.holders as h"
                            " join pgcoord.member_sessions as m on m.pid = h.pid"
                            " where m.name = %s and m.left_at is null", member.name)

    kinds = asyncio.run(run())
    assert kinds and ("semaphore",) not in kinds


async def test_a_holder_on_a_pool_of_one_refuses_a_wait_at_once(dsn: str) -> None:
    """Small pools: a wait needs a connection of its own, which a pool of one
    cannot lend; the holder says so at once instead of waiting out the pool."""
    name = unique("sem-pool1")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    other = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(pool) as holder:
            async with holder.semaphore(name, limit=1, wait=False):
                pass  # a free slot rides on the main connection
            async with pgcoord.semaphore(other, name, limit=1):
                started = time.monotonic()
                with pytest.raises(pgcoord.PoolExhausted):
                    async with holder.semaphore(name, limit=1, timeout=30):
                        pass
                assert time.monotonic() - started < 2
    finally:
        await other.close()
        await pool.close()
    assert _semaphore_locks(dsn, name) == 0


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_a_waiting_connection_borrowed_from_a_pool_goes_back_clean(
    dsn: str, kind: str,
) -> None:
    """holder.semaphore() waits on a connection borrowed from the holder's pool,
    which goes back with no lock, no LISTEN and no listener of ours (asyncpg's
    pool warns of a listener left on a connection released to it)."""
    import warnings

    name = unique("sem-borrowed")
    blocker = await asyncpg.connect(dsn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with open_async(kind, dsn, size=2) as pool, pgcoord.LockHolder(pool) as holder:
            for how in ("granted", "timeout"):
                release = asyncio.Event()

                async def hold(release: asyncio.Event = release) -> None:
                    async with pgcoord.semaphore(blocker, name, limit=1):
                        await release.wait()

                held = asyncio.create_task(hold())
                await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
                if how == "timeout":
                    with pytest.raises(pgcoord.LockTimeout):
                        async with holder.semaphore(name, limit=1, timeout=0.2):
                            pass
                    release.set()
                else:
                    waiter = asyncio.create_task(_holder_once(holder, name))
                    await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
                    release.set()
                    await asyncio.wait_for(waiter, 5)
                await held
            await _wait_until(lambda: _semaphore_locks(dsn, name) == 0)
            for _ in range(2):  # every connection of the pool, the borrowed one too
                async with _checked_out(kind, pool) as conn:
                    await _assert_clean_async(conn)
    await blocker.close()
    assert not [w for w in caught if "listener" in str(w.message)], [str(w.message) for w in caught]


async def _holder_once(holder: pgcoord.LockHolder, name: str) -> None:
    async with holder.semaphore(name, limit=1, timeout=10):
        pass


@pytest.mark.usefixtures("no_recheck")
@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool", "sa-async-psycopg"])
async def test_a_failing_commit_frees_the_slot_wakes_a_waiter_and_gives_back_clean(
    dsn: str, kind: str,
) -> None:
    """A deferred constraint fails the COMMIT: the caller gets its error, the slot
    is free, a waiter is told (the NOTIFY queued with the acquire was lost with
    the transaction; pgcoord sends it after its rollback) and the connection goes
    back with no transaction, lock or LISTEN."""
    name, table = unique("sem-commit"), f"sem_deferred_{unique('t').split(':')[1]}"
    sql(dsn, f"create table {table} (x int unique deferrable initially deferred)")
    waiter_conn = await asyncpg.connect(dsn)
    async with open_async(kind, dsn, size=1) as source:
        release = asyncio.Event()

        async def failing_holder() -> None:
            async with pgcoord.semaphore(source, name, limit=1) as conn:
                await release.wait()
                stmt = f"insert into {table} values (1), (1)"
                if hasattr(conn, "exec_driver_sql"):
                    await conn.exec_driver_sql(stmt)
                else:
                    await conn.execute(stmt)

        held = asyncio.create_task(failing_holder())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
        waiter = asyncio.create_task(_hold_once(waiter_conn, name))
        await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
        release.set()
        with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
            await held
        await asyncio.wait_for(waiter, 5)
        async with _checked_out(kind, source) as conn:
            await _assert_clean_async(conn)
    await waiter_conn.close()
    assert _semaphore_locks(dsn, name) == 0


async def test_cancelling_a_holder_wait_leaves_nothing_behind(dsn: str) -> None:
    name = unique("sem-holder-cancel")
    blocker = await asyncpg.connect(dsn)
    async with pgcoord.LockHolder(dsn, max_wait_connections=1) as holder:
        async with pgcoord.semaphore(blocker, name, limit=1):
            waiter = asyncio.create_task(_holder_once(holder, name))
            await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert [g for _, _, g in _lanes(dsn, name)] == [True]
            # the waiting connection was given back: a new wait may take one
            with pytest.raises(pgcoord.LockTimeout):
                await _holder_once_within(holder, name, 0.1)
        async with holder.semaphore(name, limit=1, wait=False):
            pass
    await blocker.close()
    assert _semaphore_locks(dsn, name) == 0


async def _holder_once_within(holder: pgcoord.LockHolder, name: str, seconds: float) -> None:
    async with holder.semaphore(name, limit=1, timeout=seconds):
        pass


async def test_a_wait_behind_a_transaction_mode_pooler_leaves_no_session_lock(dsn: str) -> None:
    """Behind PgBouncer in transaction mode each statement may run on another
    server session, so a wait must hold nothing at session level (a lane or the
    waiting room left on some server session would stay there): it retries whole
    transactions instead, and nothing is left once it is over."""
    import psycopg_pool

    from .pgbouncer import PgBouncer

    name = unique("sem-pooler")
    # Several server sessions, used in turn: consecutive statements of one client
    # land on different ones, as they may under load.
    bouncer = PgBouncer(int(dsn.rsplit(":", 1)[1].split("/")[0]),
                        extra="server_round_robin = 1\nmin_pool_size = 3\n")
    blocker = await asyncpg.connect(dsn)
    try:
        async with psycopg_pool.AsyncConnectionPool(
            bouncer.dsn(dsn), min_size=1, max_size=2, open=False,
            kwargs={"prepare_threshold": None},
        ) as pool:
            release = asyncio.Event()

            async def hold() -> None:
                async with pgcoord.semaphore(blocker, name, limit=1):
                    await release.wait()

            held = asyncio.create_task(hold())
            await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
            waiter = asyncio.create_task(_hold_once(pool, name))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            release.set()
            await asyncio.wait_for(asyncio.gather(held, waiter), 5)
            with pytest.raises(pgcoord.LockTimeout):
                async with pgcoord.semaphore(blocker, name, limit=1), \
                        pgcoord.semaphore(pool, name, limit=1, timeout=0.3):
                    pass
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0)
    finally:
        await blocker.close()
        bouncer.stop()


async def test_without_the_schema_a_semaphore_says_how_to_install_it(fresh_db: str) -> None:
    pool = await asyncpg.create_pool(fresh_db, min_size=1, max_size=1)
    try:
        with pytest.raises(pgcoord.SchemaMissing, match="migrate"):
            async with pgcoord.semaphore(pool, "no-schema", limit=1):
                pass
        async with pool.acquire() as conn:  # the connection went back usable
            assert not conn.is_in_transaction()
            assert await conn.fetchval("select 1") == 1
        async with pgcoord.LockHolder(fresh_db) as holder:
            with pytest.raises(pgcoord.SchemaMissing):
                async with holder.semaphore("no-schema", limit=1):
                    pass
    finally:
        await pool.close()


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_cancelling_during_commit_frees_the_slot(dsn: str, kind: str) -> None:
    """A COMMIT that runs a slow deferred trigger is cancelled: the caller gets its
    CancelledError, the slot is freed whatever the server made of the COMMIT, and
    the pool's connection is clean (or was closed)."""
    name, table = unique("sem-cancel-commit"), f"sem_slow_{unique('t').split(':')[1]}"
    sql(dsn, f"create table {table} (x int)")
    sql(dsn, f"create function {table}_slow() returns trigger language plpgsql"
             " as $$ begin perform pg_sleep(3); return null; end $$")
    sql(dsn, f"create constraint trigger slow after insert on {table}"
             f" deferrable initially deferred for each row execute function {table}_slow()")
    async with open_async(kind, dsn, size=1) as source:
        async def body() -> None:
            async with pgcoord.semaphore(source, name, limit=1) as conn:
                await conn.execute(f"insert into {table} values (1)")

        task = asyncio.create_task(body())
        await _wait_until(lambda: bool(sql(
            dsn, "select 1 from pg_stat_activity where query ilike 'commit%%'"
                 " and state = 'active'")))
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 6  # bounded by the cleanup's 5 s
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0, 10)
        async with pgcoord.semaphore(source, name, limit=1, timeout=5) as conn:
            pass
        async with _checked_out(kind, source) as conn:
            await _assert_clean_async(conn)


# -- review fixes --------------------------------------------------------------------

async def test_a_member_slot_whose_release_overruns_is_released_later(dsn: str) -> None:
    """On a member's session (which outlives the holder's carrier) a release that
    queues past the cleanup bound behind another statement is still sent once the
    session is free: the slot does not stay taken for the member's lifetime."""
    name = unique("sem-overrun")
    async with pgcoord.Member(dsn, group=unique("g")) as member, \
            pgcoord.LockHolder(member) as holder:
        holder._cleanup_bound = 0.3
        async with holder.semaphore(name, limit=1):
            busy = asyncio.create_task(member._call("select pg_sleep(1.2)"))
            await asyncio.sleep(0.05)
        await busy
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0, 5)
        other = await asyncpg.connect(dsn)
        try:
            async with pgcoord.semaphore(other, name, limit=1, wait=False):
                pass
        finally:
            await other.close()


@pytest.mark.parametrize("kind", ["asyncpg-conn", "psycopg-conn"])
async def test_a_nested_semaphore_that_would_wait_for_itself_raises_at_once(
    dsn: str, kind: str,
) -> None:
    """Inside a block that holds every slot this transaction (or this task on one
    holder) can count, a nested wait could only wait for itself: it raises at
    once, saying so, instead of waiting forever."""
    name = unique("sem-nested")
    async with open_async(kind, dsn, size=1) as conn:
        async with pgcoord.semaphore(conn, name, limit=1):
            started = time.monotonic()
            with pytest.raises(pgcoord.PgcoordError, match="already holds"):
                async with pgcoord.semaphore(conn, name, limit=1):
                    pass
            assert time.monotonic() - started < 2
            async with pgcoord.semaphore(conn, name, limit=2):  # a free slot of its own
                pass
    async with pgcoord.LockHolder(dsn) as holder:
        async with holder.semaphore(name, limit=1):
            started = time.monotonic()
            with pytest.raises(pgcoord.PgcoordError, match="already holds"):
                async with holder.semaphore(name, limit=1):
                    pass
            assert time.monotonic() - started < 2
    assert _semaphore_locks(dsn, name) == 0


def test_a_nested_sync_semaphore_that_would_wait_for_itself_raises_at_once(dsn: str) -> None:
    name = unique("sem-nested-sync")
    with psycopg.connect(dsn) as conn, pgcoord.semaphore(conn, name, limit=1):
        with pytest.raises(pgcoord.PgcoordError, match="already holds"):
            with pgcoord.semaphore(conn, name, limit=1, timeout=5):
                pass
    assert _semaphore_locks(dsn, name) == 0


def test_adopting_a_lane_never_blocks(dsn: str) -> None:
    """The adopt step (a waiter's session-level lane becomes its transaction's)
    must never queue in the server: a lane this session does not hold, which
    another session does, is refused at once, not waited for."""
    key = semaphore_key(unique("sem-adopt"))
    with psycopg.connect(dsn, autocommit=True) as other, psycopg.connect(dsn) as conn:
        other.execute("select pg_advisory_lock(%s, 0)", (key,))
        conn.execute("set statement_timeout = '3s'")
        started = time.monotonic()
        with pytest.raises(psycopg.Error, match="was not held") as info:
            conn.execute("select pgcoord.semaphore_adopt_xact(%s, 0)", (key,))
        assert info.value.sqlstate != "57014"  # not the statement timeout
        assert time.monotonic() - started < 2


def test_a_sync_wait_on_a_socket_numbered_above_1023(dsn: str) -> None:
    """select() cannot watch a descriptor >= FD_SETSIZE (1024): a sync waiter whose
    connection got one must wait like any other, not fail with ValueError."""
    import resource

    name = unique("sem-fd")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    pad: list[int] = []
    try:
        while not pad or pad[-1] < 1100:
            pad.append(os.open(os.devnull, os.O_RDONLY))
        with psycopg.connect(dsn) as blocker, psycopg.connect(dsn) as conn:
            assert conn.pgconn.socket >= 1024
            release = threading.Timer(0.3, lambda: blocker.commit())
            with pgcoord.semaphore(blocker, name, limit=1):
                pass
            blocker.execute("select pgcoord.semaphore_take_xact(%s, 1)", (semaphore_key(name),))
            release.start()
            with pgcoord.semaphore(conn, name, limit=1, timeout=10):
                pass
            release.join()
            _assert_clean_sync(conn)
    finally:
        for fd in pad:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _semaphore_locks(dsn, name) == 0


def test_a_sync_engine_on_a_driver_it_cannot_listen_on_waits_by_retrying(dsn: str) -> None:
    """SQLAlchemy over pg8000 (or psycopg2): pgcoord cannot hear notifications
    there, so a busy semaphore is waited for by retrying whole transactions with
    growing pauses (as behind a pooler), not refused with a driver TypeError."""
    import pg8000  # noqa: F401 - a dev dependency: missing, the test fails rather than skips
    from sqlalchemy import create_engine, text

    name = unique("sem-pg8000")
    engine = create_engine(dsn.replace("postgresql://", "postgresql+pg8000://"), pool_size=1)
    try:
        with psycopg.connect(dsn) as blocker:
            with pgcoord.semaphore(blocker, name, limit=1):
                pass
            blocker.execute("select pgcoord.semaphore_take_xact(%s, 1)", (semaphore_key(name),))
            threading.Timer(0.3, blocker.commit).start()
            started = time.monotonic()
            with pgcoord.semaphore(engine, name, limit=1, timeout=10) as conn:
                assert conn.execute(text("select 1")).scalar() == 1
            assert 0.2 < time.monotonic() - started < 5
            with pytest.raises(pgcoord.LockTimeout):
                with pgcoord.semaphore(blocker, name, limit=1), \
                        pgcoord.semaphore(engine, name, limit=1, timeout=0.3):
                    pass
        with engine.connect() as conn:
            _assert_clean_sync(conn)
    finally:
        engine.dispose()
    assert _semaphore_locks(dsn, name) == 0


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_a_commit_with_nobody_waiting_sends_no_notification(dsn: str, kind: str) -> None:
    """A NOTIFY makes every commit that sends one take a database-wide lock, one
    at a time: a semaphore's commit sends it only when someone is in the waiting
    room (a waiter enters before its first try, so one that came later saw the
    lane free). Waiters being woken by it is tested above with no_recheck."""
    name = unique("sem-quiet")
    listener = await asyncpg.connect(dsn)
    heard: list[str] = []
    await listener.add_listener("pgcoord_semaphores",
                                lambda _c, _p, _ch, payload: heard.append(payload))
    try:
        async with open_async(kind, dsn, size=1) as source:
            for _ in range(3):
                async with pgcoord.semaphore(source, name, limit=2) as conn:
                    await conn.execute("select 1")
            with pytest.raises(RuntimeError):
                async with pgcoord.semaphore(source, name, limit=2):
                    raise RuntimeError("rolled back")
        await listener.execute("select 1")
        await asyncio.sleep(0.2)
        assert str(semaphore_key(name)) not in heard
    finally:
        await listener.close()


@pytest.mark.usefixtures("no_recheck")
async def test_closing_a_holder_under_a_body_wakes_a_waiter(dsn: str) -> None:
    """LockHolder.close() with a body still in a slot releases the lane with the
    session's give-back: a waiter elsewhere is told (not left to the recheck)."""
    name = unique("sem-close")
    waiter_conn = await asyncpg.connect(dsn)
    holder = pgcoord.LockHolder(dsn)
    await holder.open()
    entered = asyncio.Event()

    async def body() -> None:
        async with holder.semaphore(name, limit=1):
            entered.set()
            await asyncio.sleep(30)

    held = asyncio.create_task(body())
    try:
        await entered.wait()
        waiter = asyncio.create_task(_hold_once(waiter_conn, name))
        await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
        await holder.close()
        with pytest.raises(pgcoord.LockLost):
            await held
        await asyncio.wait_for(waiter, 5)
    finally:
        held.cancel()
        await waiter_conn.close()


@pytest.mark.usefixtures("no_recheck")
async def test_a_wait_cancelled_after_its_lane_was_adopted_wakes_the_next(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter cancelled once its lane became its transaction's (the adopt ran,
    which let go of the session-level lane) frees the lane with its rollback:
    the next waiter is told."""
    name = unique("sem-adopt-cancel")
    real_adopt = pgcoord.locks.semaphores.SemaphoreRequest.adopt

    def slow_adopt(self: Any, lane: int) -> Any:
        stmt = real_adopt(self, lane)
        sql_text = stmt.bound.rstrip().rstrip(";") + ", pg_catalog.pg_sleep(2)"
        return type(stmt)(sql_text, sql_text, ())

    monkeypatch.setattr(pgcoord.locks.semaphores.SemaphoreRequest, "adopt", slow_adopt)
    key = semaphore_key(name)
    async with open_async("asyncpg-conn", dsn, size=1) as first, \
            open_async("psycopg-conn", dsn, size=1) as second:
        blocker = await asyncpg.connect(dsn)
        try:
            tx = blocker.transaction()
            await tx.start()
            await blocker.fetchval("select pgcoord.semaphore_take_xact($1, 1)", key)
            waiter = asyncio.create_task(_hold_once(first, name))
            await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
            await tx.commit()  # the notification wakes `first`, which adopts slowly
            await blocker.fetchval("select pgcoord.semaphore_wake($1)", key)
            await _wait_until(lambda: bool(sql(
                dsn, "select 1 from pg_stat_activity where query like %s and state = 'active'",
                "%semaphore_adopt_xact%pg_sleep(2)%")))
            monkeypatch.setattr(pgcoord.locks.semaphores.SemaphoreRequest, "adopt", real_adopt)
            second_waiter = asyncio.create_task(_hold_once(second, name))
            await _wait_until(lambda: sorted(g for _, _, g in _lanes(dsn, name)) == [False, True])
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await asyncio.wait_for(second_waiter, 5)
        finally:
            await blocker.close()
    assert _semaphore_locks(dsn, name) == 0


async def test_a_holder_try_cancelled_by_the_server_leaves_no_lane(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session-level try the server cancels (statement_timeout here) after it
    took a lane: the session locks survive the error, so pgcoord lets go of the
    lane it never recorded instead of keeping it for the holder's lifetime."""
    name = unique("sem-57014")
    real_query = pgcoord.holder.semaphore.query

    def slow_query(which: str) -> str:
        if which != "semaphore_try_session":
            return real_query(which)
        return ("WITH t AS MATERIALIZED (SELECT pgcoord.semaphore_try($1, $2, true,"
                " CAST($3 AS integer[])) AS l) SELECT t.l FROM t,"
                " LATERAL pg_catalog.pg_sleep(CASE WHEN t.l IS NULL THEN 0 ELSE 1 END)")

    async with pgcoord.LockHolder(dsn) as holder:
        async with holder.semaphore(name, limit=2, wait=False):  # records the name
            pass
        assert holder._main is not None
        await holder._main.call("SET statement_timeout = '200ms'")
        monkeypatch.setattr(pgcoord.holder.semaphore, "query", slow_query)
        with pytest.raises(Exception, match="(?i)cancel"):
            async with holder.semaphore(name, limit=2, wait=False):
                pass
        monkeypatch.setattr(pgcoord.holder.semaphore, "query", real_query)
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0, 3)


async def test_a_wait_failing_after_it_got_its_lane_forgets_the_lane(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder's wait that fails between getting its lane and returning (here
    its stop-listening raises) frees the lane and forgets it: a stale note would
    make any later user of that connection in this process skip the lane."""
    name = unique("sem-stale")
    key = semaphore_key(name)
    real_listen = pgcoord.holder.semaphore._listen

    async def failing_listen(carrier: Any, callback: Any) -> Any:
        stop = await real_listen(carrier, callback)

        failed: list[bool] = []

        async def failing_stop() -> None:
            await stop()
            if not failed:  # once: the give-up stops listening again
                failed.append(True)
                raise RuntimeError("stop failed")

        return failing_stop

    monkeypatch.setattr(pgcoord.holder.semaphore, "_listen", failing_listen)
    blocker = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn) as holder:
            tx = blocker.transaction()
            await tx.start()
            await blocker.fetchval("select pgcoord.semaphore_take_xact($1, 1)", key)
            waiter = asyncio.create_task(_holder_once(holder, name))
            await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
            await tx.commit()
            await blocker.fetchval("select pgcoord.semaphore_wake($1)", key)
            with pytest.raises(RuntimeError, match="stop failed"):
                await asyncio.wait_for(waiter, 5)
            assert not [lanes for lanes in pgcoord.holder.semaphore._held_lanes.values()
                        if any(k == key for k, _ in lanes)]
            await _wait_until(lambda: _semaphore_locks(dsn, name) == 0)
    finally:
        await blocker.close()


async def test_a_member_try_that_overruns_after_taking_a_lane_leaves_none(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a member's session a try that gets no answer within the bound (here it
    took a lane, then sleeps) gives the holder LockLost; the member's session
    lives on, so the lane it took is found and released there afterwards."""
    name = unique("sem-try-overrun")
    real_query = pgcoord.holder.semaphore.query

    def slow_query(which: str) -> str:
        if which != "semaphore_try_session":
            return real_query(which)
        return ("WITH t AS MATERIALIZED (SELECT pgcoord.semaphore_try($1, $2, true,"
                " CAST($3 AS integer[])) AS l) SELECT t.l FROM t,"
                " LATERAL pg_catalog.pg_sleep(CASE WHEN t.l IS NULL THEN 0 ELSE 1 END)")

    async with pgcoord.Member(dsn, group=unique("g")) as member, \
            pgcoord.LockHolder(member) as holder:
        holder._cleanup_bound = 0.3
        async with holder.semaphore(name, limit=1, wait=False):  # records the name
            pass
        monkeypatch.setattr(pgcoord.holder.semaphore, "query", slow_query)
        with pytest.raises(pgcoord.LockLost):
            async with holder.semaphore(name, limit=1, wait=False):
                pass
        monkeypatch.setattr(pgcoord.holder.semaphore, "query", real_query)
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0, 5)
        assert member.has_session


@pytest.mark.usefixtures("no_recheck")
@pytest.mark.parametrize("kind", ["asyncpg-conn", "psycopg-conn"])
async def test_a_body_that_commits_inside_is_told_and_wakes_a_waiter(dsn: str, kind: str) -> None:
    """A body that ends the slot's transaction itself gets PgcoordError at the
    block's end; its COMMIT freed the slot, and a waiter is told."""
    name = unique("sem-early")
    waiter_conn = await asyncpg.connect(dsn)
    async with open_async(kind, dsn, size=1) as source:
        release = asyncio.Event()

        async def body() -> None:
            async with pgcoord.semaphore(source, name, limit=1) as conn:
                await release.wait()
                await conn.execute("COMMIT")

        held = asyncio.create_task(body())
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 1)
        waiter = asyncio.create_task(_hold_once(waiter_conn, name))
        await _wait_until(lambda: len(_lanes(dsn, name)) == 2)
        release.set()
        with pytest.raises(pgcoord.PgcoordError, match="ended inside the block"):
            await held
        await asyncio.wait_for(waiter, 5)
        await _assert_clean_async(source)
    await waiter_conn.close()
    assert _semaphore_locks(dsn, name) == 0


async def test_closing_a_member_holder_under_a_body_releases_its_lane(dsn: str) -> None:
    """LockHolder(member).close() with a body still in a slot: the member's session
    lives on, so the lane must be released on it (not left for its lifetime)."""
    name = unique("sem-close-member")
    async with pgcoord.Member(dsn, group=unique("g")) as member:
        holder = pgcoord.LockHolder(member)
        await holder.open()
        entered = asyncio.Event()

        async def body() -> None:
            async with holder.semaphore(name, limit=1):
                entered.set()
                await asyncio.sleep(30)

        held = asyncio.create_task(body())
        await entered.wait()
        await holder.close()
        with pytest.raises(pgcoord.LockLost):
            await held
        await _wait_until(lambda: _semaphore_locks(dsn, name) == 0, 5)
        async with pgcoord.LockHolder(member) as again, again.semaphore(name, limit=1, wait=False):
            pass
