"""A pool with no connection to lend: ``exclusive()`` and ``semaphore()`` raise
``PoolExhausted`` (as LockHolder does) once the pool's own timeout passes, not the
pool's own exception, and nothing is left checked out or held."""

from __future__ import annotations

import time

import psycopg_pool
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord

from .conftest import unique


def test_a_psycopg_pool_with_every_connection_in_use(dsn: str, locks_in: None) -> None:
    with psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=1, timeout=0.5) as pool, \
            pool.connection():
        started = time.monotonic()
        with pytest.raises(pgcoord.PoolExhausted, match="pool"), \
                pgcoord.exclusive(pool, unique("exhausted"), wait=False):
            raise AssertionError("the body ran without a connection")
        assert 0.4 < time.monotonic() - started < 5
        with pytest.raises(pgcoord.PoolExhausted), \
                pgcoord.semaphore(pool, unique("exhausted-sem"), limit=1):
            raise AssertionError("the body ran without a connection")


async def test_an_async_psycopg_pool_with_every_connection_in_use(dsn: str, locks_in: None) -> None:
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, timeout=0.5) as pool:
        async with pool.connection():
            with pytest.raises(pgcoord.PoolExhausted):
                async with pgcoord.exclusive(pool, unique("exhausted")):
                    raise AssertionError("the body ran without a connection")
        async with pgcoord.exclusive(pool, unique("exhausted")):
            pass  # the pool still lends once it has a connection


def test_a_sqlalchemy_engine_with_every_connection_in_use(dsn: str, locks_in: None) -> None:
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"),
                           pool_size=1, max_overflow=0, pool_timeout=0.5)
    try:
        with engine.connect(), pytest.raises(pgcoord.PoolExhausted), \
                pgcoord.exclusive(engine, unique("exhausted")):
            raise AssertionError("the body ran without a connection")
        with pgcoord.exclusive(engine, unique("exhausted")):
            pass
    finally:
        engine.dispose()


async def test_an_async_sqlalchemy_engine_with_every_connection_in_use(dsn: str, locks_in: None) -> None:
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"),
                                 pool_size=1, max_overflow=0, pool_timeout=0.5)
    try:
        async with engine.connect():
            with pytest.raises(pgcoord.PoolExhausted):
                async with pgcoord.exclusive(engine, unique("exhausted")):
                    raise AssertionError("the body ran without a connection")
    finally:
        await engine.dispose()


async def test_a_server_that_does_not_answer_is_not_an_exhausted_pool() -> None:
    """asyncpg's pool has no checkout timeout of its own (pgcoord gives it none): a
    TimeoutError there is its connect timing out, which says nothing of connections
    in use."""
    import asyncio
    import socket

    import asyncpg

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts, never answers
    port = listener.getsockname()[1]
    try:
        pool = asyncpg.create_pool(f"postgresql://postgres@127.0.0.1:{port}/x",
                                   min_size=0, max_size=1, timeout=0.5)
        await pool
        try:
            with pytest.raises(TimeoutError) as raised:
                async with pgcoord.exclusive(pool, unique("silent")):
                    raise AssertionError("the body ran without a server")
            assert not isinstance(raised.value, pgcoord.PoolExhausted)
        finally:
            pool.terminate()
            await asyncio.sleep(0)
    finally:
        listener.close()
