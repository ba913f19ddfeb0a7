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
