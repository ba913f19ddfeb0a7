"""What sending BEGIN and the lock as one message must not change.

To save psycopg's own BEGIN round trip pgcoord switches a psycopg connection to
autocommit for the length of the block and writes the BEGIN itself; under
SQLAlchemy it writes the BEGIN its driver would have sent. These tests hold it
to the caller's settings: autocommit comes back as it was, the isolation level
and read-only mode are the ones the caller configured, an AUTOCOMMIT engine
still gets a transaction that holds the lock, and a connection in pipeline mode
still works.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord

from .conftest import advisory_locks, unique


def _sa_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


class Boom(Exception):
    pass


@pytest.mark.parametrize("autocommit", [False, True])
async def test_psycopg_async_autocommit_comes_back_as_it_was(
    dsn: str, autocommit: bool, locks_in: None,
) -> None:
    key = unique("one-trip")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
        async with pgcoord.exclusive(conn, key):
            assert (await (await conn.execute("select now() = statement_timestamp()")).fetchone()) \
                == (False,), "the body runs inside the lock's transaction"
        assert conn.autocommit is autocommit
        with pytest.raises(Boom):
            async with pgcoord.exclusive(conn, key):
                raise Boom
        assert conn.autocommit is autocommit
        async with await psycopg.AsyncConnection.connect(dsn) as other, pgcoord.exclusive(other, key):
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.exclusive(conn, key, wait=False):
                    pass
        assert conn.autocommit is autocommit
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.parametrize("autocommit", [False, True])
def test_psycopg_sync_autocommit_comes_back_as_it_was(
    dsn: str, autocommit: bool, locks_in: None,
) -> None:
    key = unique("one-trip")
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        with pgcoord.exclusive(conn, key):
            assert conn.execute("select now() = statement_timestamp()").fetchone() == (False,)
        assert conn.autocommit is autocommit
        with pytest.raises(Boom), pgcoord.exclusive(conn, key):
            raise Boom
        assert conn.autocommit is autocommit
        with (
            psycopg.connect(dsn) as other, pgcoord.exclusive(other, key),
            pytest.raises(pgcoord.LockBusy), pgcoord.exclusive(conn, key, wait=False),
        ):
            pass
        assert conn.autocommit is autocommit
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


async def _characteristics_async(conn: Any) -> tuple[str, str]:
    if hasattr(conn, "exec_driver_sql"):
        level = (await conn.exec_driver_sql("show transaction_isolation")).scalar_one()
        read_only = (await conn.exec_driver_sql("show transaction_read_only")).scalar_one()
        return level, read_only
    level = (await (await conn.execute("show transaction_isolation")).fetchone())[0]
    read_only = (await (await conn.execute("show transaction_read_only")).fetchone())[0]
    return level, read_only


def _characteristics_sync(conn: Any) -> tuple[str, str]:
    if hasattr(conn, "exec_driver_sql"):
        return (conn.exec_driver_sql("show transaction_isolation").scalar_one(),
                conn.exec_driver_sql("show transaction_read_only").scalar_one())
    return (conn.execute("show transaction_isolation").fetchone()[0],
            conn.execute("show transaction_read_only").fetchone()[0])


async def test_psycopg_async_isolation_and_read_only_are_kept(dsn: str, locks_in: None) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.set_isolation_level(psycopg.IsolationLevel.SERIALIZABLE)
        await conn.set_read_only(True)
        async with pgcoord.exclusive(conn, unique("one-trip")):
            assert await _characteristics_async(conn) == ("serializable", "on")


def test_psycopg_sync_isolation_and_read_only_are_kept(dsn: str, locks_in: None) -> None:
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with pgcoord.exclusive(conn, unique("one-trip")):
            assert _characteristics_sync(conn) == ("repeatable read", "on")


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_sqlalchemy_async_engine_isolation_is_kept(
    dsn: str, driver: str, locks_in: None,
) -> None:
    engine = create_async_engine(_sa_url(dsn, driver), isolation_level="REPEATABLE READ")
    try:
        async with pgcoord.exclusive(engine, unique("one-trip")) as conn:
            assert await _characteristics_async(conn) == ("repeatable read", "off")
        ro = engine.execution_options(isolation_level="SERIALIZABLE", postgresql_readonly=True)
        async with ro.connect() as conn, pgcoord.exclusive(conn, unique("one-trip")):
            assert await _characteristics_async(conn) == ("serializable", "on")
    finally:
        await engine.dispose()


def test_sqlalchemy_sync_engine_isolation_is_kept(dsn: str, locks_in: None) -> None:
    engine = create_engine(_sa_url(dsn, "psycopg"), isolation_level="SERIALIZABLE")
    try:
        with pgcoord.exclusive(engine, unique("one-trip")) as conn:
            assert _characteristics_sync(conn) == ("serializable", "off")
    finally:
        engine.dispose()


@pytest.fixture
def table(dsn: str) -> str:
    name = unique("t").replace(":", "_")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"create table {name} (id int)")
    return name


def _count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute(f"select count(*) from {table}").fetchone()[0])  # type: ignore[index]


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_autocommit_async_engine_still_holds_the_lock(
    dsn: str, driver: str, table: str, locks_in: None,
) -> None:
    """An xact lock taken in autocommit is released as soon as it is granted, so
    pgcoord opens a transaction even on an AUTOCOMMIT engine; the body's writes
    belong to it."""
    key = unique("one-trip")
    engine = create_async_engine(_sa_url(dsn, driver), isolation_level="AUTOCOMMIT")
    try:
        async with pgcoord.exclusive(engine, key) as conn:
            await conn.exec_driver_sql(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
            assert _count(dsn, table) == 0, "not committed before the block ends"
        assert _count(dsn, table) == 1
        with pytest.raises(Boom):
            async with pgcoord.exclusive(engine, key) as conn:
                await conn.exec_driver_sql(f"insert into {table} values (2)")
                raise Boom
        assert _count(dsn, table) == 1
    finally:
        await engine.dispose()


def test_an_autocommit_sync_engine_still_holds_the_lock(
    dsn: str, table: str, locks_in: None,
) -> None:
    key = unique("one-trip")
    engine = create_engine(_sa_url(dsn, "psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with pgcoord.exclusive(engine, key) as conn:
            conn.exec_driver_sql(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
            assert _count(dsn, table) == 0
        assert _count(dsn, table) == 1
        with pytest.raises(Boom), pgcoord.exclusive(engine, key) as conn:
            conn.exec_driver_sql(f"insert into {table} values (2)")
            raise Boom
        assert _count(dsn, table) == 1
    finally:
        engine.dispose()


async def test_a_psycopg_async_connection_in_pipeline_mode(dsn: str, table: str, locks_in: None) -> None:
    key = unique("one-trip")
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        async with pgcoord.exclusive(conn, key):
            await conn.execute(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert advisory_locks(dsn) == []
    assert _count(dsn, table) == 1


def test_a_psycopg_sync_connection_in_pipeline_mode(dsn: str, table: str, locks_in: None) -> None:
    key = unique("one-trip")
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with pgcoord.exclusive(conn, key):
            conn.execute(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert advisory_locks(dsn) == []
    assert _count(dsn, table) == 1


async def test_without_asyncpg_internals_sqlalchemy_takes_the_lock_its_own_way(
    dsn: str, table: str, monkeypatch: pytest.MonkeyPatch, locks_in: None,
) -> None:
    """If a later asyncpg moved the attribute pgcoord registers its transaction
    in, SQLAlchemy's own BEGIN is used instead; on an AUTOCOMMIT engine, where
    that BEGIN never happens, pgcoord refuses rather than hold no lock."""
    from pgcoord._drivers import asyncpg as asyncpg_adapter

    monkeypatch.setattr(asyncpg_adapter, "can_adopt", lambda conn: False)
    key = unique("one-trip")
    engine = create_async_engine(_sa_url(dsn, "asyncpg"))
    try:
        async with pgcoord.exclusive(engine, key) as conn:
            await conn.exec_driver_sql(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert _count(dsn, table) == 1
        with pytest.raises(pgcoord.UnsupportedConnection, match="AUTOCOMMIT"):
            async with pgcoord.exclusive(
                engine.execution_options(isolation_level="AUTOCOMMIT"), key,
            ):
                pass
    finally:
        await engine.dispose()
