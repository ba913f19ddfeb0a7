"""No lock on a hot standby.

PostgreSQL grants advisory locks on a hot standby, and they exclude only the
standby's own sessions: a replica whose DSN names a node that became a standby
(the old primary after a switchover) would "hold" a lock that another replica
holds on the primary at the same moment. ``exclusive()``, ``semaphore()`` and
``LockHolder`` refuse, with a message that says what to do; once the standby is
promoted, the same connections take locks again.
"""

from __future__ import annotations

from collections.abc import Iterator

import asyncpg
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord

from .conftest import unique
from .ha import StandbyPair

# The module runs in one worker, in order (--dist loadfile): the last test promotes.


@pytest.fixture(scope="module")
def pair() -> Iterator[StandbyPair]:
    with StandbyPair(synchronous=False) as pair:
        yield pair


def _advisory_locks_on(dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("select pid, objid from pg_locks where locktype = 'advisory'"
                            " and pid <> pg_backend_pid()").fetchall()


async def test_async_sources_on_a_standby_are_refused(pair: StandbyPair) -> None:
    dsn = pair.standby.dsn
    key = unique("standby")
    conn = await asyncpg.connect(dsn)
    aconn = await psycopg.AsyncConnection.connect(dsn)
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    try:
        for source in (conn, aconn, engine):
            with pytest.raises(pgcoord.PgcoordError, match="hot standby"):
                async with pgcoord.exclusive(source, key):
                    raise AssertionError("the body ran on a standby")
            assert _advisory_locks_on(dsn) == []
        assert aconn.autocommit is False
        assert aconn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert await conn.fetchval("select 1") == 1
        with pytest.raises(pgcoord.PgcoordError, match="hot standby"):
            async with pgcoord.LockHolder(dsn) as holder, holder.lock(key):
                raise AssertionError("the body ran on a standby")
        assert _advisory_locks_on(dsn) == []
    finally:
        await conn.close()
        await aconn.close()
        await engine.dispose()


def test_a_lock_in_a_callers_sqlalchemy_transaction_on_a_standby_is_refused(pair: StandbyPair) -> None:
    """The check then runs in the caller's transaction: SQLAlchemy refuses a
    transaction of pgcoord's own there."""
    dsn = pair.standby.dsn
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn, conn.begin():
            with pytest.raises(pgcoord.PgcoordError, match="hot standby"), \
                    pgcoord.exclusive(conn, unique("standby")):
                raise AssertionError("the body ran on a standby")
            assert conn.execute(text("select 1")).scalar() == 1  # the transaction goes on
    finally:
        engine.dispose()
    assert _advisory_locks_on(dsn) == []


def test_sync_sources_on_a_standby_are_refused(pair: StandbyPair) -> None:
    dsn = pair.standby.dsn
    key = unique("standby")
    with psycopg.connect(dsn) as conn:
        with pytest.raises(pgcoord.PgcoordError, match="hot standby"), pgcoord.exclusive(conn, key):
            raise AssertionError("the body ran on a standby")
        with pytest.raises(pgcoord.PgcoordError, match="hot standby"), \
                pgcoord.semaphore(conn, unique("standby-sem"), limit=2):
            raise AssertionError("the body ran on a standby")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _advisory_locks_on(dsn) == []


async def test_connections_opened_before_a_promotion_take_locks_after_it(pair: StandbyPair) -> None:
    """Each connection reported in_hot_standby = on when it was made; the report
    changes only with its next answer, so pgcoord asks the server before refusing."""
    dsn = pair.standby.dsn
    key = unique("standby")
    conn = await asyncpg.connect(dsn)
    aconn = await psycopg.AsyncConnection.connect(dsn)
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    saconn = await engine.connect()
    try:
        pair.promote()
        # What each connection last heard: a standby, still.
        assert conn.get_settings().in_hot_standby == "on"
        assert aconn.info.parameter_status("in_hot_standby") == "on"
        for source in (conn, aconn):
            async with pgcoord.exclusive(source, key):
                assert len(_advisory_locks_on(dsn)) == 1
        # In a caller's transaction that has sent nothing yet (SQLAlchemy's BEGIN
        # waits for the first statement): the check runs in it, and passes.
        async with saconn.begin(), pgcoord.exclusive(saconn, key):
            assert len(_advisory_locks_on(dsn)) == 1
        assert _advisory_locks_on(dsn) == []
    finally:
        await conn.close()
        await aconn.close()
        await saconn.close()
        await engine.dispose()
