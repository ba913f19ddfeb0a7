"""asyncpg: ``Pool``, ``Connection`` and pooled connection proxies."""

from __future__ import annotations

from typing import Any

import asyncpg
import asyncpg.pool
from asyncpg.transaction import Transaction, TransactionState

from .base import AsyncTxSession, LockStatement, begin_and_lock

CONNECTION_TYPES = (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)
POOL_TYPES = (asyncpg.Pool,)


def _raw(conn: Any) -> Any:
    """The real Connection behind a pool proxy (the proxy forwards reads only)."""
    return getattr(conn, "_con", None) or conn


# Whether asyncpg still keeps its transaction where begin_locked_adopted() puts it.
_ADOPTABLE = "_top_xact" in getattr(asyncpg.Connection, "__slots__", ()) and hasattr(Transaction, "start")


def can_adopt(conn: Any) -> bool:
    return _ADOPTABLE


async def begin_locked_adopted(conn: Any, message: str) -> Transaction:
    """Send ``BEGIN; <lock>`` as one simple-protocol message, and return it as
    asyncpg's own transaction.

    asyncpg only lets ``Connection.transaction()`` nest (as savepoints) inside a
    transaction it started itself, so the transaction is registered as one: the
    body can then use ``conn.transaction()`` normally.
    """
    raw = _raw(conn)
    await raw.execute(message)
    tx = raw.transaction()
    tx._state = TransactionState.STARTED
    raw._top_xact = tx
    return tx


class AsyncpgSession(AsyncTxSession):
    # Pool.release() runs under asyncio.shield inside asyncpg.
    checkin_shielded_by_driver = True

    def __init__(self, source: Any) -> None:
        self._pool: asyncpg.Pool | None = source if isinstance(source, POOL_TYPES) else None
        self.conn = None if self._pool is not None else source
        # The Connection itself: a pool proxy's methods cost a dispatch each.
        self._raw: Any = None if self.conn is None else _raw(self.conn)
        self._tx: Transaction | None = None

    async def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = await self._pool.acquire()
            self._raw = _raw(self.conn)
        return self.conn

    def in_transaction(self) -> bool:
        return bool(self._raw.is_in_transaction())

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        row = await self.conn.fetchrow(sql, *params)
        return None if row is None else tuple(row)

    async def begin_locked(self, lock: LockStatement) -> None:
        if not can_adopt(self.conn):
            self._tx = self.conn.transaction()
            await self._tx.start()
            await self.conn.execute(lock.bound, *lock.params)
            return
        self._tx = await begin_locked_adopted(self._raw, begin_and_lock(lock))

    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        async with self.conn.transaction():
            await self.conn.execute(lock.bound, *lock.params)

    async def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            await tx.commit()

    async def rollback(self) -> None:
        tx, self._tx = self._tx, None
        raw = _raw(self.conn)
        if tx is not None and raw._top_xact is tx:
            await tx.rollback()
        else:
            # BEGIN;lock failed or was cancelled before the transaction was
            # registered. The status asyncpg reports may predate the BEGIN while
            # a cancellation is still in flight, so roll back unconditionally:
            # outside a transaction ROLLBACK only warns.
            await self.conn.execute("ROLLBACK")

    async def discard(self) -> None:
        self._tx = None
        _raw(self.conn).terminate()

    async def checkin(self) -> None:
        if self._pool is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            await self._pool.release(conn)
