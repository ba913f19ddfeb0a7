"""exclusive() on every async source: docs/exclusive.md checked against a real server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

import pgcoord
from pgcoord._drivers.psycopg import GUARD_CANCEL

from .conftest import advisory_locks
from .sources import ASYNC_CONNS, ASYNC_POOLS, aexecute, apid, open_async

ALL = ASYNC_POOLS + ASYNC_CONNS


class Blocker:
    """Another session that holds advisory locks in an open transaction."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, application_name="blocker")

    def hold(self, key: int | str, shared: bool = False) -> None:
        fn = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        self.conn.execute(f"select {fn}(%s)", (pgcoord.lock_key(key),))

    def release(self) -> None:
        self.conn.rollback()

    @property
    def pid(self) -> int:
        return self.conn.info.backend_pid


@pytest.fixture
def blocker(dsn: str) -> Iterator[Blocker]:
    b = Blocker(dsn)
    yield b
    b.conn.close()


@pytest.fixture
def table(dsn: str) -> Iterator[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("drop table if exists things; create table things (id int primary key)")
    yield "things"


def rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("select id from things order by id")]


@contextlib.asynccontextmanager
async def nested(conn: Any) -> AsyncIterator[None]:
    """The driver's own savepoint API."""
    if hasattr(conn, "begin_nested"):
        async with conn.begin_nested():
            yield
    else:
        async with conn.transaction():
            yield


async def begin_caller_transaction(conn: Any) -> Any:
    """Open a transaction the way a user of this driver would, return its closer."""
    if hasattr(conn, "begin_nested"):
        return await conn.begin()
    if hasattr(conn, "get_server_pid"):  # asyncpg
        tx = conn.transaction()
        await tx.start()
        return tx
    await conn.execute("select 1")  # psycopg: autocommit off, a statement opens one
    return conn


async def commit_caller_transaction(conn: Any, tx: Any) -> None:
    await tx.commit()


@pytest.mark.parametrize("kind", ALL)
async def test_holds_the_lock_inside_a_transaction_and_commits_on_exit(
    kind: str, dsn: str, table: str,
) -> None:
    async with open_async(kind, dsn) as source:
        async with pgcoord.exclusive(source, "exclusive:basic") as conn:
            pid = await apid(conn)
            held = advisory_locks(dsn)
            assert held == [(pid, pgcoord.lock_key("exclusive:basic"), True)]
            await aexecute(conn, "insert into things values (1)")
        assert advisory_locks(dsn) == []
        assert rows(dsn) == [1]


@pytest.mark.parametrize("kind", ALL)
async def test_an_exception_rolls_back_releases_and_propagates(kind: str, dsn: str, table: str) -> None:
    async with open_async(kind, dsn) as source:
        with pytest.raises(ZeroDivisionError):
            async with pgcoord.exclusive(source, 17) as conn:
                await aexecute(conn, "insert into things values (2)")
                1 / 0  # noqa: B018
        assert advisory_locks(dsn) == []
        assert rows(dsn) == []
        async with pgcoord.exclusive(source, 17, wait=False):
            pass


@pytest.mark.parametrize("kind", ALL)
async def test_a_body_that_commits_itself_is_told_so(kind: str, dsn: str, table: str) -> None:
    """Committing inside the block releases the lock mid-block; exit says so
    instead of committing nothing, and the connection is still fine."""
    async with open_async(kind, dsn) as source:
        with pytest.raises(pgcoord.PgcoordError, match="ended inside the block"):
            async with pgcoord.exclusive(source, "exclusive:self-commit") as conn:
                await aexecute(conn, "insert into things values (5)")
                if hasattr(conn, "get_server_pid"):  # asyncpg: no commit() of its own
                    await conn.execute("COMMIT")
                else:
                    await conn.commit()
                assert advisory_locks(dsn) == []
        assert rows(dsn) == [5]
        async with pgcoord.exclusive(source, "exclusive:self-commit") as conn:
            await aexecute(conn, "insert into things values (6)")
        assert rows(dsn) == [5, 6]
        assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
async def test_busy_raises_lock_busy_at_once(kind: str, dsn: str, blocker: Blocker) -> None:
    blocker.hold("exclusive:busy")
    async with open_async(kind, dsn) as source:
        started = time.monotonic()
        with pytest.raises(pgcoord.LockBusy, match="exclusive:busy"):
            async with pgcoord.exclusive(source, "exclusive:busy", wait=False):
                pytest.fail("body ran although the lock is held elsewhere")
        assert time.monotonic() - started < 2.0
        assert [pid for pid, _, _ in advisory_locks(dsn)] == [blocker.pid]
        blocker.release()
        async with pgcoord.exclusive(source, "exclusive:busy", wait=False):
            pass
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
async def test_timeout_is_enforced_by_the_server(kind: str, dsn: str, blocker: Blocker) -> None:
    blocker.hold("exclusive:timeout")
    async with open_async(kind, dsn) as source:
        started = time.monotonic()
        with pytest.raises(pgcoord.LockTimeout):
            async with pgcoord.exclusive(source, "exclusive:timeout", timeout=0.3):
                pytest.fail("body ran although the lock is held elsewhere")
        elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < 5.0
        assert [pid for pid, _, _ in advisory_locks(dsn)] == [blocker.pid]
        blocker.release()
        # lock_timeout applied to the lock statement only, not to the body.
        async with pgcoord.exclusive(source, "exclusive:timeout", timeout=0.3) as conn:
            await aexecute(conn, "select 1")
            if hasattr(conn, "exec_driver_sql"):
                value = (await conn.exec_driver_sql("show lock_timeout")).scalar_one()
            elif hasattr(conn, "fetchval"):
                value = await conn.fetchval("show lock_timeout")
            else:
                value = (await (await conn.execute("show lock_timeout")).fetchone())[0]
            assert value == "0"


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_shared_is_compatible_with_shared_but_not_with_exclusive(kind: str, dsn: str) -> None:
    async with open_async(kind, dsn) as source:
        async with pgcoord.exclusive(source, "exclusive:shared", shared=True):
            async with pgcoord.exclusive(source, "exclusive:shared", shared=True, wait=False):
                assert len(advisory_locks(dsn)) == 2
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.exclusive(source, "exclusive:shared", wait=False):
                    pass
        async with pgcoord.exclusive(source, "exclusive:shared"):
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.exclusive(source, "exclusive:shared", shared=True, wait=False):
                    pass
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ASYNC_CONNS)
@pytest.mark.parametrize("how", ["busy", "timeout"])
async def test_a_failed_attempt_leaves_the_callers_transaction_usable(
    kind: str, how: str, dsn: str, table: str, blocker: Blocker,
) -> None:
    blocker.hold("exclusive:joined")
    async with open_async(kind, dsn) as conn:
        tx = await begin_caller_transaction(conn)
        await aexecute(conn, "insert into things values (10)")
        options: dict[str, Any] = {"wait": False} if how == "busy" else {"timeout": 0.2}
        with pytest.raises(pgcoord.LockBusy if how == "busy" else pgcoord.LockTimeout):
            async with pgcoord.exclusive(conn, "exclusive:joined", **options):
                pass
        await aexecute(conn, "insert into things values (11)")
        await commit_caller_transaction(conn, tx)
    assert rows(dsn) == [10, 11]


@pytest.mark.parametrize("kind", ASYNC_CONNS)
async def test_inside_a_callers_transaction_the_lock_joins_it(kind: str, dsn: str, table: str) -> None:
    async with open_async(kind, dsn) as conn:
        tx = await begin_caller_transaction(conn)
        async with pgcoord.exclusive(conn, "exclusive:join") as same:
            assert same is conn
            await aexecute(conn, "insert into things values (20)")
        # pgcoord neither committed nor released: the caller's transaction holds it.
        assert len(advisory_locks(dsn)) == 1
        assert rows(dsn) == []
        await commit_caller_transaction(conn, tx)
    assert rows(dsn) == [20]
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
async def test_the_body_can_use_the_drivers_savepoints(kind: str, dsn: str, table: str) -> None:
    async with open_async(kind, dsn) as source:
        async with pgcoord.exclusive(source, "exclusive:nested") as conn:
            await aexecute(conn, "insert into things values (30)")
            with pytest.raises(RuntimeError):
                async with nested(conn):
                    await aexecute(conn, "insert into things values (31)")
                    raise RuntimeError("undo the savepoint only")
            async with nested(conn):
                await aexecute(conn, "insert into things values (32)")
    assert rows(dsn) == [30, 32]
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
async def test_cancelled_while_waiting_leaves_no_lock_and_a_usable_source(
    kind: str, dsn: str, blocker: Blocker,
) -> None:
    blocker.hold("exclusive:cancel-wait")
    async with open_async(kind, dsn) as source:
        entered = False

        async def waiter() -> None:
            nonlocal entered
            async with pgcoord.exclusive(source, "exclusive:cancel-wait"):
                entered = True

        task = asyncio.create_task(waiter())
        for _ in range(200):  # until the server shows it waiting
            if any(not granted for _, _, granted in advisory_locks(dsn)):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the waiter never reached the server")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not entered
        assert [pid for pid, _, granted in advisory_locks(dsn) if granted] == [blocker.pid]
        blocker.release()
        if GUARD_CANCEL and "psycopg" in kind:
            # psycopg < 3.2 cannot cancel without blocking the event loop: the
            # connection was closed instead, and its wait, still queued on the
            # server, ends as soon as the lock is granted to it.
            for _ in range(200):
                if not advisory_locks(dsn):
                    break
                await asyncio.sleep(0.02)
            if kind == "psycopg-conn":
                assert source.closed
                return
        async with pgcoord.exclusive(source, "exclusive:cancel-wait", wait=False) as conn:
            await aexecute(conn, "select 1")
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
async def test_cancelled_while_holding_releases_the_lock(kind: str, dsn: str, table: str) -> None:
    async with open_async(kind, dsn) as source:
        holding = asyncio.Event()

        async def holder() -> None:
            async with pgcoord.exclusive(source, "exclusive:cancel-hold") as conn:
                await aexecute(conn, "insert into things values (40)")
                holding.set()
                await asyncio.sleep(60)

        task = asyncio.create_task(holder())
        await asyncio.wait_for(holding.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert advisory_locks(dsn) == []
        assert rows(dsn) == []
        async with pgcoord.exclusive(source, "exclusive:cancel-hold", wait=False) as conn:
            await aexecute(conn, "select 1")


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_fifty_tasks_never_overlap_and_all_get_a_turn(kind: str, dsn: str) -> None:
    inside = 0
    most_inside = 0
    turns: list[int] = []

    async with open_async(kind, dsn, size=8) as source:

        async def worker(i: int) -> None:
            nonlocal inside, most_inside
            async with pgcoord.exclusive(source, "exclusive:fifty"):
                inside += 1
                most_inside = max(most_inside, inside)
                await asyncio.sleep(0.002)
                turns.append(i)
                inside -= 1

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(50))), 120)
    assert most_inside == 1
    assert sorted(turns) == list(range(50))
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ASYNC_POOLS)
async def test_opposite_order_on_two_keys_raises_deadlock(kind: str, dsn: str) -> None:
    async with open_async(kind, dsn) as source:
        both_hold_first = asyncio.Barrier(2)

        async def take(first: str, second: str) -> str:
            # The second lock joins the first one's transaction: one session
            # waiting on another is a cycle the server can see.
            async with pgcoord.exclusive(source, first) as conn:
                await both_hold_first.wait()
                async with pgcoord.exclusive(conn, second):
                    return "ok"

        results = await asyncio.wait_for(
            asyncio.gather(take("dl:a", "dl:b"), take("dl:b", "dl:a"), return_exceptions=True), 30
        )
    assert sorted(type(r).__name__ for r in results) == ["Deadlock", "str"]
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool", "sa-async-asyncpg"])
async def test_holders_shows_the_name_holder_and_a_waiter(kind: str, dsn: str) -> None:
    name = f"exclusive:visible:{kind}"  # a name this process has never used
    async with open_async(kind, dsn) as source:
        holding = asyncio.Event()
        done = asyncio.Event()

        async def holder() -> None:
            async with pgcoord.exclusive(source, name):
                holding.set()
                await done.wait()

        async def waiter() -> None:
            async with pgcoord.exclusive(source, name):
                pass

        t1 = asyncio.create_task(holder())
        await holding.wait()
        t2 = asyncio.create_task(waiter())
        view: list[Any] = []
        for _ in range(200):
            with psycopg.connect(dsn) as conn:
                view = conn.execute(
                    "select name, key, pid, application_name, granted, blocked_by, holder"
                    " from pgcoord.holders where key = pgcoord.lock_key(%s)"
                    " order by granted desc", (name,)
                ).fetchall()
            if len(view) == 2:
                break
            await asyncio.sleep(0.01)
        done.set()
        await asyncio.gather(t1, t2)
    assert len(view) == 2
    (hname, hkey, hpid, happ, hgranted, _, hholder), (wname, _, wpid, _, wgranted, wblocked, _) = view
    assert (hname, hkey, happ, hgranted, hholder) == (
        name, pgcoord.lock_key(name), "pgcoord-test", True, "pgcoord-test")
    assert (wname, wgranted, wblocked) == (name, False, [hpid])
    assert wpid != hpid


async def test_locks_work_without_the_schema(fresh_db: str) -> None:
    async with open_async("asyncpg-pool", fresh_db) as source:
        async with pgcoord.exclusive(source, "no-schema-here") as conn:
            assert await conn.fetchval("select count(*) from pg_locks where locktype = 'advisory'") == 1
    assert advisory_locks(fresh_db) == []


@pytest.mark.parametrize("key", [True, 1.5, None, b"x"])
async def test_bad_keys_raise_type_error_at_the_call(key: object, dsn: str) -> None:
    async with open_async("asyncpg-pool", dsn) as source:
        pgcoord.exclusive(source, 1)  # validated requests are cached: look-alikes must not hit
        with pytest.raises(TypeError):
            pgcoord.exclusive(source, key)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            pgcoord.exclusive(source, 1, wait=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            pgcoord.exclusive(source, 2**63)
        with pytest.raises(ValueError):
            pgcoord.exclusive(source, 1, timeout=-1)
        with pytest.raises(ValueError):
            pgcoord.exclusive(source, 1, wait=False, timeout=1)


async def test_a_sync_source_in_async_with_says_which_with_to_use(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError, match="use `with pgcoord.exclusive"):
            async with pgcoord.exclusive(conn, 1):
                pass
    with pytest.raises(pgcoord.UnsupportedConnection):
        pgcoord.exclusive(object(), 1)


async def test_a_name_is_recorded_once_per_process_and_then_costs_nothing(dsn: str) -> None:
    name = f"exclusive:recorded-once:{id(object())}"
    async with open_async("asyncpg-pool", dsn) as source:
        async with pgcoord.exclusive(source, name):
            pass
        with psycopg.connect(dsn, autocommit=True) as admin:
            assert admin.execute("select name from pgcoord.lock_names where key = %s",
                                 (pgcoord.lock_key(name),)).fetchall() == [(name,)]
            admin.execute("delete from pgcoord.lock_names where key = %s", (pgcoord.lock_key(name),))
        # No second insert: the process remembers the name was recorded.
        async with pgcoord.exclusive(source, name):
            pass
        with psycopg.connect(dsn, autocommit=True) as admin:
            assert admin.execute("select count(*) from pgcoord.lock_names where key = %s",
                                 (pgcoord.lock_key(name),)).fetchone() == (0,)
