"""The private driver internals exclusive() relies on, pinned to the installed versions.

To send BEGIN and the lock in one message pgcoord registers the transaction it
opened with the driver: asyncpg's ``Connection._top_xact`` and
``Transaction._state``, SQLAlchemy's asyncpg adapter ``_transaction`` (and
``_started`` on SQLAlchemy 2.0). Each use is guarded by a check that falls back
to the public path (one more round trip) when a driver release changes shape.
These tests fail loudly when that happens on the installed version: the fast
path must be the one in use, and the fallback must still be correct.
(Issue #11 item 4; item 2 was SQLAlchemy 2.0's ``_started`` missed by such a use.)
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import pytest
import sqlalchemy
from sqlalchemy.dialects.postgresql import asyncpg as sa_asyncpg
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord
from pgcoord._core import aio as _aio
from pgcoord._drivers import asyncpg as asyncpg_adapter
from pgcoord._drivers import sqlalchemy as sa_adapter

from .conftest import advisory_locks, sql, unique
from .small_pools import sa_url


@pytest.fixture
def table(dsn: str) -> str:
    name = unique("internals").replace(":", "_")
    sql(dsn, f"create table {name} (id int)")
    return name


def _sa_version() -> tuple[int, int]:
    major, minor = sqlalchemy.__version__.split(".")[:2]
    return int(major), int(minor)


# -- asyncpg ------------------------------------------------------------------------


def test_asyncpg_keeps_its_transaction_where_pgcoord_registers_it() -> None:
    assert asyncpg_adapter._ADOPTABLE, (
        f"asyncpg {asyncpg.__version__} no longer has Connection._top_xact / Transaction._state: "
        "exclusive() fell back to conn.transaction() (one more round trip); update "
        "pgcoord/_drivers/asyncpg.py for this release"
    )


async def test_a_registered_asyncpg_transaction_nests_savepoints_and_commits(dsn: str, table: str) -> None:
    """What the registration must achieve: the body's conn.transaction() is a
    savepoint of the lock's transaction, and the lock's commit ends it."""
    conn = await asyncpg.connect(dsn)
    try:
        async with pgcoord.exclusive(conn, unique("internals")):
            assert conn.is_in_transaction()
            await conn.execute(f"insert into {table} values (1)")
            with pytest.raises(ZeroDivisionError):
                async with conn.transaction():
                    await conn.execute(f"insert into {table} values (2)")
                    1 / 0  # noqa: B018
        assert not conn.is_in_transaction()
        async with conn.transaction():  # asyncpg's own bookkeeping is clean again
            await conn.execute(f"insert into {table} values (3)")
    finally:
        await conn.close()
    assert sql(dsn, f"select id from {table} order by id") == [(1,), (3,)]
    assert advisory_locks(dsn) == []


def test_a_pool_proxy_unwraps_to_the_connection(dsn: str) -> None:
    """``_raw()`` reads the proxy's ``_con`` to skip its per-call dispatch; without
    it the proxy itself is used, which works but is slower."""
    proxy_cls = asyncpg.pool.PoolConnectionProxy
    assert "_con" in {n for c in proxy_cls.__mro__ for n in getattr(c, "__slots__", ())}


@pytest.mark.parametrize("kind", ["conn", "pool"])
async def test_without_asyncpg_internals_the_public_path_is_correct(
    kind: str, dsn: str, table: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(asyncpg_adapter, "_ADOPTABLE", False)
    key = unique("internals")
    source: Any = await (
        asyncpg.connect(dsn) if kind == "conn" else asyncpg.create_pool(dsn, min_size=1, max_size=1)
    )
    try:
        async with pgcoord.exclusive(source, key) as conn:
            await conn.execute(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        with pytest.raises(KeyError):
            async with pgcoord.exclusive(source, key) as conn:
                await conn.execute(f"insert into {table} values (2)")
                raise KeyError
        async with pgcoord.exclusive(source, key, wait=False):
            pass
    finally:
        await source.close()
    assert sql(dsn, f"select id from {table}") == [(1,)]
    assert advisory_locks(dsn) == []


# -- SQLAlchemy's asyncpg adapter ------------------------------------------------------


def test_sqlalchemys_asyncpg_adapter_has_a_shape_pgcoord_knows() -> None:
    expected = "started" if _sa_version() < (2, 1) else "transaction"
    found = sa_adapter.asyncpg_adapter_protocol(sa_asyncpg.AsyncAdapt_asyncpg_connection)
    assert found == expected, (
        f"SQLAlchemy {sqlalchemy.__version__}'s asyncpg adapter tracks its transaction as "
        f"{found!r}, not {expected!r}: check pgcoord/_drivers/sqlalchemy.py against its "
        "_start_transaction/commit/rollback"
    )


async def test_the_sqlalchemy_asyncpg_fast_path_is_the_one_in_use(
    dsn: str, table: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """The transaction is handed to the adapter (no SQLAlchemy BEGIN), the
    adapter's COMMIT ends it, and the after-commit check stays silent."""
    engine = create_async_engine(sa_url(dsn, "asyncpg"), pool_size=1, max_overflow=0)
    try:
        with caplog.at_level(logging.ERROR, logger="pgcoord"):
            for i in range(3):
                async with pgcoord.exclusive(engine, unique("internals")) as conn:
                    adapter = (await conn.get_raw_connection()).dbapi_connection
                    assert isinstance(adapter._transaction, asyncpg.transaction.Transaction)
                    await conn.exec_driver_sql(f"insert into {table} values ({i})")
                assert adapter._transaction is None
        assert not caplog.records, caplog.text
        assert sa_adapter.asyncpg_adapter_protocol(type(adapter)) is not None
    finally:
        await engine.dispose()
    assert sql(dsn, f"select count(*) from {table}") == [(3,)]
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
async def test_an_adapter_that_ignores_the_handed_transaction_is_caught(
    dsn: str, table: str, outcome: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Simulate a SQLAlchemy release whose adapter does not see the transaction
    pgcoord handed it (what SQLAlchemy 2.0 did before the fix): the body's first
    statement begins a savepoint of the adapter's own, and its COMMIT releases
    only that. pgcoord notices asyncpg still in the transaction, ends it, says
    so, and takes SQLAlchemy's own BEGIN for that adapter from then on."""
    monkeypatch.setattr(sa_adapter, "_protocols", {})
    original = sa_adapter.AsyncSQLAlchemySession.begin_locked

    async def unseen(self: Any, lock: Any) -> None:
        await original(self, lock)
        self._adapter._transaction = None
        if hasattr(type(self._adapter), "_started"):
            self._adapter._started = False

    monkeypatch.setattr(sa_adapter.AsyncSQLAlchemySession, "begin_locked", unseen)
    engine = create_async_engine(sa_url(dsn, "asyncpg"), pool_size=1, max_overflow=0)
    key = unique("internals")
    try:
        with caplog.at_level(logging.ERROR, logger="pgcoord"):
            if outcome == "commit":
                async with pgcoord.exclusive(engine, key) as conn:
                    await conn.exec_driver_sql(f"insert into {table} values (1)")
            else:
                with pytest.raises(KeyError):
                    async with pgcoord.exclusive(engine, key) as conn:
                        await conn.exec_driver_sql(f"insert into {table} values (1)")
                        raise KeyError
        assert "did not end the lock's transaction" in caplog.text
        assert advisory_locks(dsn) == []
        assert sql(dsn, f"select count(*) from {table}") == [(1 if outcome == "commit" else 0,)]
        monkeypatch.setattr(sa_adapter.AsyncSQLAlchemySession, "begin_locked", original)
        async with pgcoord.exclusive(engine, key, wait=False) as conn:  # SQLAlchemy's BEGIN now
            adapter = (await conn.get_raw_connection()).dbapi_connection
            assert sa_adapter.asyncpg_adapter_protocol(type(adapter)) is None
            await conn.exec_driver_sql(f"insert into {table} values (2)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
        assert advisory_locks(dsn) == []
        assert sql(dsn, f"select count(*) from {table} where id = 2") == [(1,)]
    finally:
        await engine.dispose()


async def test_an_adapter_of_unknown_shape_takes_sqlalchemys_own_begin(
    dsn: str, table: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sa_adapter, "_protocols", {sa_asyncpg.AsyncAdapt_asyncpg_connection: None})
    engine = create_async_engine(sa_url(dsn, "asyncpg"), pool_size=1, max_overflow=0)
    key = unique("internals")
    try:
        async with pgcoord.exclusive(engine, key) as conn:
            adapter = (await conn.get_raw_connection()).dbapi_connection
            await conn.exec_driver_sql(f"insert into {table} values (1)")
            assert [k for _, k, _ in advisory_locks(dsn)] == [pgcoord.lock_key(key)]
            assert adapter._transaction is not None  # SQLAlchemy's own
    finally:
        await engine.dispose()
    assert sql(dsn, f"select count(*) from {table}") == [(1,)]
    assert advisory_locks(dsn) == []


# -- asyncio (pgcoord/_aio.py) ---------------------------------------------------------


def test_cleanups_run_their_first_step_without_a_task() -> None:
    """finish_despite_cancel steps a cleanup by hand, relying on asyncio's
    private ``_asyncio_future_blocking`` protocol; without it every cleanup
    costs a task (correct, slower)."""
    assert _aio.INLINE_FIRST_STEP
