"""asyncpg: ``Pool``, ``Connection`` and pooled connection proxies."""

from __future__ import annotations

from typing import Any

import asyncpg
import asyncpg.pool
from asyncpg.transaction import Transaction, TransactionState

from .base import AsyncTxSession, LockStatement

CONNECTION_TYPES = (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)
POOL_TYPES = (asyncpg.Pool,)


def _raw(conn: Any) -> Any:
    """The real Connection behind a pool proxy (the proxy forwards reads only)."""
    return getattr(conn, "_con", None) or conn


def _can_adopt(conn: Any) -> bool:
    raw = _raw(conn)
    return hasattr(raw, "_top_xact") and hasattr(Transaction, "start")


class AsyncpgSession(AsyncTxSession):
    # Pool.release() runs under asyncio.shield inside asyncpg.
    checkin_shielded_by_driver = True

    def __init__(self, source: Any) -> None:
        self._pool: asyncpg.Pool | None = source if isinstance(source, POOL_TYPES) else None
        self.conn = None if self._pool is not None else source
        self._tx: Transaction | None = None

    async def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = await self._pool.acquire()
        return self.conn

    def in_transaction(self) -> bool:
        return bool(self.conn.is_in_transaction())

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        row = await self.conn.fetchrow(sql, *params)
        return None if row is None else tuple(row)

    async def begin_locked(self, lock: LockStatement) -> None:
        if not _can_adopt(self.conn):
            self._tx = self.conn.transaction()
            await self._tx.start()
            await self.conn.execute(lock.bound, *lock.params)
            return
        # One simple-protocol message: BEGIN and the lock share a round trip.
        await self.conn.execute(f"BEGIN;{lock.inline}")
        # asyncpg only lets Connection.transaction() nest (as savepoints) inside
        # a transaction it started itself, so register this one as its own:
        # the body can then use conn.transaction() normally.
        tx = self.conn.transaction()
        tx._state = TransactionState.STARTED
        _raw(self.conn)._top_xact = tx
        self._tx = tx

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
