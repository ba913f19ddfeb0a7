"""exclusive() with `with` on psycopg and SQLAlchemy sync sources."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgcoord

from .conftest import advisory_locks
from .sources import SYNC_CONNS, SYNC_POOLS, open_sync, sexecute, spid
from .test_exclusive import Blocker, blocker, rows, table  # noqa: F401 - fixtures

ALL = SYNC_POOLS + SYNC_CONNS


@contextlib.contextmanager
def nested(conn: Any) -> Iterator[None]:
    with conn.begin_nested() if hasattr(conn, "begin_nested") else conn.transaction():
        yield


def begin_caller_transaction(conn: Any) -> Any:
    if hasattr(conn, "begin_nested"):
        return conn.begin()
    conn.execute("select 1")
    return conn


@pytest.mark.parametrize("kind", ALL)
def test_holds_the_lock_and_commits_on_exit(kind: str, dsn: str, table: str) -> None:
    with open_sync(kind, dsn) as source:
        with pgcoord.exclusive(source, "sync:basic") as conn:
            assert advisory_locks(dsn) == [(spid(conn), pgcoord.lock_key("sync:basic"), True)]
            sexecute(conn, "insert into things values (1)")
        assert advisory_locks(dsn) == []
    assert rows(dsn) == [1]


@pytest.mark.parametrize("kind", ALL)
def test_an_exception_rolls_back_and_releases(kind: str, dsn: str, table: str) -> None:
    with open_sync(kind, dsn) as source:
        with pytest.raises(KeyError), pgcoord.exclusive(source, "sync:rollback") as conn:
            sexecute(conn, "insert into things values (2)")
            raise KeyError("boom")
        assert advisory_locks(dsn) == []
        with pgcoord.exclusive(source, "sync:rollback", wait=False):
            pass
    assert rows(dsn) == []


@pytest.mark.parametrize("kind", ALL)
def test_a_body_that_commits_itself_is_told_so(kind: str, dsn: str, table: str) -> None:  # noqa: F811
    with open_sync(kind, dsn) as source:
        with (
            pytest.raises(pgcoord.PgcoordError, match="ended inside the block"),
            pgcoord.exclusive(source, "exclusive:self-commit") as conn,
        ):
            sexecute(conn, "insert into things values (5)")
            conn.commit()
            assert advisory_locks(dsn) == []
        assert rows(dsn) == [5]
        with pgcoord.exclusive(source, "exclusive:self-commit") as conn:
            sexecute(conn, "insert into things values (6)")
        assert rows(dsn) == [5, 6]
        assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", ALL)
def test_busy_and_timeout(kind: str, dsn: str, blocker: Blocker) -> None:  # noqa: F811
    blocker.hold("sync:busy")
    with open_sync(kind, dsn) as source:
        with pytest.raises(pgcoord.LockBusy), pgcoord.exclusive(source, "sync:busy", wait=False):
            pytest.fail("body ran")
        started = time.monotonic()
        with pytest.raises(pgcoord.LockTimeout), pgcoord.exclusive(source, "sync:busy", timeout=0.3):
            pytest.fail("body ran")
        assert 0.25 <= time.monotonic() - started < 5.0
        assert [pid for pid, _, _ in advisory_locks(dsn)] == [blocker.pid]
        blocker.release()
        with pgcoord.exclusive(source, "sync:busy", wait=False):
            pass
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("kind", SYNC_CONNS)
def test_a_failed_attempt_leaves_the_callers_transaction_usable(
    kind: str, dsn: str, table: str, blocker: Blocker,  # noqa: F811
) -> None:
    blocker.hold("sync:joined")
    with open_sync(kind, dsn) as conn:
        tx = begin_caller_transaction(conn)
        sexecute(conn, "insert into things values (10)")
        with pytest.raises(pgcoord.LockBusy), pgcoord.exclusive(conn, "sync:joined", wait=False):
            pass
        with pytest.raises(pgcoord.LockTimeout), pgcoord.exclusive(conn, "sync:joined", timeout=0.2):
            pass
        sexecute(conn, "insert into things values (11)")
        tx.commit()
    assert rows(dsn) == [10, 11]


@pytest.mark.parametrize("kind", ALL)
def test_the_body_can_use_the_drivers_savepoints(kind: str, dsn: str, table: str) -> None:
    with open_sync(kind, dsn) as source, pgcoord.exclusive(source, "sync:nested") as conn:
        sexecute(conn, "insert into things values (30)")
        with pytest.raises(RuntimeError), nested(conn):
            sexecute(conn, "insert into things values (31)")
            raise RuntimeError
        with nested(conn):
            sexecute(conn, "insert into things values (32)")
    assert rows(dsn) == [30, 32]


@pytest.mark.parametrize("kind", SYNC_POOLS)
def test_threads_contending_never_overlap(kind: str, dsn: str) -> None:
    inside, most_inside, turns = 0, 0, []
    guard = threading.Lock()
    with open_sync(kind, dsn, size=8) as source:

        def worker(i: int) -> None:
            nonlocal inside, most_inside
            with pgcoord.exclusive(source, "sync:threads"):
                with guard:
                    inside += 1
                    most_inside = max(most_inside, inside)
                time.sleep(0.002)
                with guard:
                    inside -= 1
                    turns.append(i)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert most_inside == 1
    assert sorted(turns) == list(range(20))
    assert advisory_locks(dsn) == []


async def test_an_async_source_in_a_plain_with_says_which_with_to_use(dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(dsn)
    try:
        with pytest.raises(TypeError, match="use `async with"), pgcoord.exclusive(conn, 1):
            pass
    finally:
        await conn.close()
