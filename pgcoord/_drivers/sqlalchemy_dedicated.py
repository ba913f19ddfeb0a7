"""Dedicated sessions borrowed from a SQLAlchemy ``AsyncEngine``: the driver
connection (asyncpg's or psycopg's) under a pooled SQLAlchemy connection, as that
driver's ``DedicatedSession``, given back by closing the SQLAlchemy connection."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.exc import TimeoutError as SATimeout
from sqlalchemy.pool import NullPool, QueuePool, SingletonThreadPool, StaticPool

from ..errors import PoolExhausted, UnsupportedConnection
from .adapt import dedicated
from .protocol import LEND_TIMEOUT, DedicatedSession, Lender, SessionSource


class _SQLAlchemyLender(Lender):
    def __init__(self, sa_conn: Any) -> None:
        self.sa_conn = sa_conn

    async def give_back(self, driver_conn: Any) -> None:
        await self.sa_conn.close()

    async def discard(self, driver_conn: Any) -> None:
        # invalidate() drops the pool's record of this connection (the driver
        # connection is already closed, so its own close returns at once).
        try:
            await self.sa_conn.invalidate()
        finally:
            await self.sa_conn.close()


class SQLAlchemyPoolSessions(SessionSource):
    """Dedicated sessions on the driver connections of a SQLAlchemy ``AsyncEngine``'s pool."""

    def __init__(self, engine: Any) -> None:
        if isinstance(engine.pool, StaticPool | SingletonThreadPool):
            raise UnsupportedConnection(
                f"LockHolder cannot use an engine with a {type(engine.pool).__name__}: it hands "
                "the same connection to every borrower, so session locks would be shared with "
                "them; use the default pool or NullPool"
            )
        self.engine = engine

    async def open(self) -> DedicatedSession:
        try:
            sa_conn = await self.engine.connect()
        except SATimeout as exc:
            raise PoolExhausted(
                f"the SQLAlchemy pool lent no connection to LockHolder within its timeout: {exc}"
            ) from exc
        return await self._adopt(sa_conn)

    def _can_lend_now(self) -> bool:
        pool = self.engine.pool
        if isinstance(pool, NullPool):
            return True
        if isinstance(pool, QueuePool):
            # QueuePool keeps its overflow limit private; without it, ask anyway.
            max_overflow = getattr(pool, "_max_overflow", None)
            if not isinstance(max_overflow, int):
                return True
            return pool.checkedin() > 0 or max_overflow < 0 or pool.overflow() < max_overflow
        return True

    async def open_now(self) -> DedicatedSession | None:
        if not self._can_lend_now():
            return None
        try:
            async with asyncio.timeout(LEND_TIMEOUT):
                sa_conn = await self.engine.connect()
        except (TimeoutError, SATimeout):
            return None
        return await self._adopt(sa_conn)

    async def _adopt(self, sa_conn: Any) -> DedicatedSession:
        try:
            raw = await sa_conn.get_raw_connection()
            driver = raw.driver_connection
            return dedicated(driver, _SQLAlchemyLender(sa_conn))
        except BaseException:
            await sa_conn.invalidate()
            await sa_conn.close()
            raise
