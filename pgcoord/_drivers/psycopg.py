"""psycopg 3: ``AsyncConnectionPool``, ``AsyncConnection``, ``ConnectionPool``, ``Connection``.

The transaction is psycopg's own ``conn.transaction()`` block, so the body's
nested ``conn.transaction()`` calls become savepoints as usual. Pipeline mode
would let BEGIN and the lock share a round trip, but entering and leaving it
cost more than the round trip saves on loopback (bench/locks.py measured
about 40% fewer acquisitions per second), so statements are sent plainly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from .._queries import to_pyformat
from .base import AsyncTxSession, LockStatement, SyncTxSession

try:
    import psycopg_pool
except ImportError:  # psycopg without psycopg-pool: connections only
    psycopg_pool = None  # type: ignore[assignment]

ASYNC_CONNECTION_TYPES: tuple[type, ...] = (psycopg.AsyncConnection,)
SYNC_CONNECTION_TYPES: tuple[type, ...] = (psycopg.Connection,)
ASYNC_POOL_TYPES: tuple[type, ...] = (
    (psycopg_pool.AsyncConnectionPool,) if psycopg_pool is not None else ()
)
SYNC_POOL_TYPES: tuple[type, ...] = (
    (psycopg_pool.ConnectionPool,) if psycopg_pool is not None else ()
)

def _in_transaction(conn: Any) -> bool:
    return bool(conn.info.transaction_status != TransactionStatus.IDLE)


class AsyncPsycopgSession(AsyncTxSession):
    def __init__(self, source: Any) -> None:
        self._pool: Any = source if isinstance(source, ASYNC_POOL_TYPES) else None
        self.conn: psycopg.AsyncConnection[Any] | None = None if self._pool else source
        self._tx = contextlib.AsyncExitStack()

    async def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = await self._pool.getconn()
        return self.conn

    def in_transaction(self) -> bool:
        return _in_transaction(self.conn)

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        async with self.conn.transaction():
            cur = await self.conn.execute(to_pyformat(sql), params)
            return await cur.fetchone() if cur.description else None

    async def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        await self._tx.enter_async_context(self.conn.transaction())
        await self.conn.execute(to_pyformat(lock.bound), lock.params or None)

    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        async with self.conn.transaction():
            await self.conn.execute(to_pyformat(lock.bound), lock.params or None)

    async def commit(self) -> None:
        stack, self._tx = self._tx, contextlib.AsyncExitStack()
        await stack.aclose()

    async def rollback(self) -> None:
        assert self.conn is not None
        stack, self._tx = self._tx, contextlib.AsyncExitStack()
        with contextlib.suppress(_Rollback):
            await stack.__aexit__(_Rollback, _Rollback(), None)
        if self.conn.info.transaction_status != TransactionStatus.IDLE:
            await self.conn.rollback()

    async def discard(self) -> None:
        self._tx = contextlib.AsyncExitStack()
        if self.conn is not None:
            await self.conn.close()

    async def checkin(self) -> None:
        if self._pool is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            await self._pool.putconn(conn)


class SyncPsycopgSession(SyncTxSession):
    def __init__(self, source: Any) -> None:
        self._pool: Any = source if isinstance(source, SYNC_POOL_TYPES) else None
        self.conn: psycopg.Connection[Any] | None = None if self._pool else source
        self._tx = contextlib.ExitStack()

    def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = self._pool.getconn()
        return self.conn

    def in_transaction(self) -> bool:
        return _in_transaction(self.conn)

    def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        with self.conn.transaction():
            cur = self.conn.execute(to_pyformat(sql), params)
            return cur.fetchone() if cur.description else None

    def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx.enter_context(self.conn.transaction())
        self.conn.execute(to_pyformat(lock.bound), lock.params or None)

    def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        with self.conn.transaction():
            self.conn.execute(to_pyformat(lock.bound), lock.params or None)

    def commit(self) -> None:
        stack, self._tx = self._tx, contextlib.ExitStack()
        stack.close()

    def rollback(self) -> None:
        assert self.conn is not None
        stack, self._tx = self._tx, contextlib.ExitStack()
        with contextlib.suppress(_Rollback):
            stack.__exit__(_Rollback, _Rollback(), None)
        if self.conn.info.transaction_status != TransactionStatus.IDLE:
            self.conn.rollback()

    def discard(self) -> None:
        self._tx = contextlib.ExitStack()
        if self.conn is not None:
            self.conn.close()

    def checkin(self) -> None:
        if self._pool is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            self._pool.putconn(conn)


class _Rollback(Exception):
    """Passed into psycopg's transaction block so that it rolls back."""
