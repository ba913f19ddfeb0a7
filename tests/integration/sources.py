"""Every kind of source exclusive() accepts, opened on a test database.

Async sources are opened with ``open_async(kind, dsn)`` and sync ones with
``open_sync(kind, dsn)``; both are context managers yielding the source.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

APP = "pgcoord-test"

ASYNC_POOLS = ["asyncpg-pool", "psycopg-pool", "sa-async-asyncpg", "sa-async-psycopg"]
ASYNC_CONNS = ["asyncpg-conn", "asyncpg-pooled-conn", "psycopg-conn", "sa-async-conn"]
SYNC_POOLS = ["psycopg-sync-pool", "sa-sync-engine"]
SYNC_CONNS = ["psycopg-sync-conn", "sa-sync-conn"]


def _sa_url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


@contextlib.asynccontextmanager
async def open_async(kind: str, dsn: str, size: int = 4) -> AsyncIterator[Any]:
    if kind == "asyncpg-pool":
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=size,
                                         server_settings={"application_name": APP})
        try:
            yield pool
        finally:
            await pool.close()
    elif kind == "asyncpg-pooled-conn":
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1,
                                         server_settings={"application_name": APP})
        try:
            async with pool.acquire() as conn:
                yield conn
        finally:
            await pool.close()
    elif kind == "asyncpg-conn":
        conn = await asyncpg.connect(dsn, server_settings={"application_name": APP})
        try:
            yield conn
        finally:
            await conn.close()
    elif kind == "psycopg-pool":
        async with psycopg_pool.AsyncConnectionPool(
            dsn, min_size=1, max_size=size, open=False, kwargs={"application_name": APP},
        ) as apool:
            yield apool
    elif kind == "psycopg-conn":
        async with await psycopg.AsyncConnection.connect(dsn, application_name=APP) as aconn:
            yield aconn
    elif kind in ("sa-async-asyncpg", "sa-async-psycopg", "sa-async-conn"):
        driver = "psycopg" if kind == "sa-async-psycopg" else "asyncpg"
        args = ({"server_settings": {"application_name": APP}} if driver == "asyncpg"
                else {"application_name": APP})
        engine = create_async_engine(_sa_url(dsn, driver), pool_size=size, connect_args=args)
        try:
            if kind == "sa-async-conn":
                async with engine.connect() as saconn:
                    yield saconn
            else:
                yield engine
        finally:
            await engine.dispose()
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def open_sync(kind: str, dsn: str, size: int = 4) -> Iterator[Any]:
    if kind == "psycopg-sync-pool":
        with psycopg_pool.ConnectionPool(
            dsn, min_size=1, max_size=size, open=False, kwargs={"application_name": APP},
        ) as pool:
            yield pool
    elif kind == "psycopg-sync-conn":
        with psycopg.connect(dsn, application_name=APP) as conn:
            yield conn
    elif kind in ("sa-sync-engine", "sa-sync-conn"):
        engine = create_engine(_sa_url(dsn, "psycopg"), pool_size=size,
                               connect_args={"application_name": APP})
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


def backend_pid(conn: Any) -> int:
    """The server pid behind any connection object a source yields."""
    if hasattr(conn, "get_server_pid"):
        return int(conn.get_server_pid())
    if hasattr(conn, "info") and hasattr(conn.info, "backend_pid"):
        return int(conn.info.backend_pid)
    raise TypeError(type(conn))


async def apid(conn: Any) -> int:
    """Backend pid for any async connection, SQLAlchemy's included."""
    if hasattr(conn, "exec_driver_sql"):
        result = await conn.exec_driver_sql("select pg_backend_pid()")
        return int(result.scalar_one())
    return backend_pid(conn)


def spid(conn: Any) -> int:
    if hasattr(conn, "exec_driver_sql"):
        return int(conn.exec_driver_sql("select pg_backend_pid()").scalar_one())
    return backend_pid(conn)


async def aexecute(conn: Any, sql: str) -> None:
    if hasattr(conn, "exec_driver_sql"):
        await conn.exec_driver_sql(sql)
    else:
        await conn.execute(sql)


def sexecute(conn: Any, sql: str) -> None:
    if hasattr(conn, "exec_driver_sql"):
        conn.exec_driver_sql(sql)
    else:
        conn.execute(sql)
