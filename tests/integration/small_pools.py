"""Every source exclusive() accepts, holding ONE connection, and what its next
borrower sees.

With a pool of ``max_size=1`` the next borrower gets the very connection that
exclusive() gave back, so a connection returned in autocommit, inside a
transaction or holding a lock shows up in :func:`state_async` /
:func:`state_sync`. A bare connection is its own next borrower.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

APP = "pgcoord-small"

ASYNC_KINDS = [
    "asyncpg-pool", "asyncpg-conn", "psycopg-pool", "psycopg-conn",
    "sa-async-asyncpg", "sa-async-psycopg", "sa-async-conn-asyncpg", "sa-async-conn-psycopg",
]
SYNC_KINDS = ["psycopg-sync-pool", "psycopg-sync-conn", "sa-sync-engine", "sa-sync-conn"]
# The sources whose driver pgcoord switches to autocommit for one round trip.
PSYCOPG_UNDERNEATH = {"psycopg-pool", "psycopg-conn", "sa-async-psycopg", "sa-async-conn-psycopg",
                      "psycopg-sync-pool", "psycopg-sync-conn", "sa-sync-engine", "sa-sync-conn"}


def sa_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


@contextlib.asynccontextmanager
async def open_async(
    kind: str, dsn: str, *, serializable: bool = False, asyncpg_class: type | None = None,
) -> AsyncIterator[Any]:
    """One connection's worth of ``kind``: a pool or engine of size 1, or a bare connection."""
    level = psycopg.IsolationLevel.SERIALIZABLE if serializable else None
    if kind in ("asyncpg-pool", "asyncpg-conn"):
        settings = {"application_name": APP}
        if serializable:
            settings["default_transaction_isolation"] = "serializable"
        extra: dict[str, Any] = {"connection_class": asyncpg_class} if asyncpg_class else {}
        if kind == "asyncpg-pool":
            pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1, server_settings=settings,
                                             **extra)
            try:
                yield pool
            finally:
                pool.terminate()
        else:
            conn = await asyncpg.connect(dsn, server_settings=settings, **extra)
            try:
                yield conn
            finally:
                conn.terminate()
    elif kind == "psycopg-pool":
        async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.set_isolation_level(level)

        async with psycopg_pool.AsyncConnectionPool(
            dsn, min_size=1, max_size=1, open=False, timeout=5, configure=configure,
            kwargs={"application_name": APP},
        ) as pool:
            yield pool
    elif kind == "psycopg-conn":
        async with await psycopg.AsyncConnection.connect(dsn, application_name=APP) as conn:
            await conn.set_isolation_level(level)
            yield conn
    elif kind.startswith("sa-async-"):
        driver = kind.rsplit("-", 1)[1]
        args = ({"server_settings": {"application_name": APP}} if driver == "asyncpg"
                else {"application_name": APP})
        options: dict[str, Any] = {"isolation_level": "SERIALIZABLE"} if serializable else {}
        engine = create_async_engine(sa_url(dsn, driver), pool_size=1, max_overflow=0,
                                     pool_timeout=5, connect_args=args, **options)
        try:
            if "-conn-" in kind:
                async with engine.connect() as saconn:
                    yield saconn
            else:
                yield engine
        finally:
            await engine.dispose()
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def open_sync(kind: str, dsn: str, *, serializable: bool = False) -> Iterator[Any]:
    level = psycopg.IsolationLevel.SERIALIZABLE if serializable else None
    if kind == "psycopg-sync-pool":
        def configure(conn: psycopg.Connection[Any]) -> None:
            conn.isolation_level = level

        with psycopg_pool.ConnectionPool(
            dsn, min_size=1, max_size=1, open=False, timeout=5, configure=configure,
            kwargs={"application_name": APP},
        ) as pool:
            yield pool
    elif kind == "psycopg-sync-conn":
        with psycopg.connect(dsn, application_name=APP) as conn:
            conn.isolation_level = level
            yield conn
    elif kind in ("sa-sync-engine", "sa-sync-conn"):
        options: dict[str, Any] = {"isolation_level": "SERIALIZABLE"} if serializable else {}
        engine = create_engine(sa_url(dsn, "psycopg"), pool_size=1, max_overflow=0, pool_timeout=5,
                               connect_args={"application_name": APP}, **options)
        try:
            if kind == "sa-sync-conn":
                with engine.connect() as conn:
                    yield conn
            else:
                yield engine
        finally:
            engine.dispose()
    else:
        raise ValueError(kind)


@contextlib.asynccontextmanager
async def borrow_async(kind: str, source: Any) -> AsyncIterator[tuple[Any, Any]]:
    """What the next user of ``source`` gets: (its connection, the driver's connection)."""
    if kind == "asyncpg-pool":
        async with source.acquire() as conn:
            yield conn, conn
    elif kind == "psycopg-pool":
        async with source.connection() as conn:
            yield conn, conn
    elif kind in ("asyncpg-conn", "psycopg-conn"):
        yield source, source
    elif "-conn-" in kind:
        yield source, (await source.get_raw_connection()).driver_connection
    else:
        async with source.connect() as saconn:
            yield saconn, (await saconn.get_raw_connection()).driver_connection


@contextlib.contextmanager
def borrow_sync(kind: str, source: Any) -> Iterator[tuple[Any, Any]]:
    if kind == "psycopg-sync-pool":
        with source.connection() as conn:
            yield conn, conn
    elif kind == "psycopg-sync-conn":
        yield source, source
    elif kind == "sa-sync-conn":
        yield source, source.connection.driver_connection
    else:
        with source.connect() as saconn:
            yield saconn, saconn.connection.driver_connection


def pid_of(driver_conn: Any) -> int:
    if isinstance(driver_conn, psycopg.BaseConnection):
        return int(driver_conn.info.backend_pid)
    return int(driver_conn.get_server_pid())


def observe(dsn: str, pid: int) -> tuple[str | None, list[int]]:
    """What another session sees of backend ``pid``: its state and advisory locks."""
    with psycopg.connect(dsn, autocommit=True) as obs:
        row = obs.execute("select state from pg_stat_activity where pid = %s", (pid,)).fetchone()
        locks = obs.execute(
            "select (classid::bigint << 32) | objid::bigint from pg_locks"
            " where locktype = 'advisory' and pid = %s", (pid,),
        ).fetchall()
    return (None if row is None else row[0]), [k for (k,) in locks]


PROBE = "select current_setting('transaction_isolation'), current_setting('transaction_read_only'),"\
        " current_setting('lock_timeout'), current_setting('statement_timeout')"


def _client_side(driver: Any) -> tuple[Any, ...]:
    if isinstance(driver, psycopg.BaseConnection):
        return ("psycopg", driver.autocommit, driver.isolation_level, driver.read_only,
                driver.deferrable, driver.info.transaction_status.name)
    return ("asyncpg", driver.is_in_transaction())


async def state_async(kind: str, source: Any, dsn: str) -> dict[str, Any]:
    """How the next borrower finds its connection, and how a transaction of its
    own behaves on it (written the driver's normal way): is it a transaction,
    with which characteristics, and is nothing left over."""
    async with borrow_async(kind, source) as (conn, driver):
        pid = pid_of(driver)
        state: dict[str, Any] = {"pid": pid, "client": _client_side(driver),
                                 "before": observe(dsn, pid)}
        if kind.startswith("asyncpg"):
            async with conn.transaction():
                probe = tuple(await conn.fetchrow(PROBE))
                inside = observe(dsn, pid)
        elif kind.startswith("psycopg"):
            # autocommit off: the statement opens a transaction the server shows.
            probe = await (await conn.execute(PROBE)).fetchone()
            inside = observe(dsn, pid)
            await conn.rollback()
        else:
            async with conn.begin():
                probe = tuple((await conn.execute(text(PROBE))).one())
                inside = observe(dsn, pid)
        state.update(probe=probe, inside=inside, after=observe(dsn, pid),
                     client_after=_client_side(driver))
        return state


def state_sync(kind: str, source: Any, dsn: str) -> dict[str, Any]:
    with borrow_sync(kind, source) as (conn, driver):
        pid = pid_of(driver)
        state: dict[str, Any] = {"pid": pid, "client": _client_side(driver),
                                 "before": observe(dsn, pid)}
        if kind.startswith("psycopg"):
            probe = conn.execute(PROBE).fetchone()
            inside = observe(dsn, pid)
            conn.rollback()
        else:
            with conn.begin():
                probe = tuple(conn.execute(text(PROBE)).one())
                inside = observe(dsn, pid)
        state.update(probe=probe, inside=inside, after=observe(dsn, pid),
                     client_after=_client_side(driver))
        return state


def same_but_pid(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({k: v for k, v in a.items() if k != "pid"}, {k: v for k, v in b.items() if k != "pid"})
