"""asyncpg: ``Pool``, ``Connection`` and pooled connection proxies."""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import asyncpg.pool
from asyncpg.transaction import Transaction, TransactionState

from .. import _aio
from .base import AsyncTxSession, LockStatement, begin_and_lock

log = logging.getLogger("pgcoord")

CONNECTION_TYPES = (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)
POOL_TYPES = (asyncpg.Pool,)


def _raw(conn: Any) -> Any:
    """The real Connection behind a pool proxy (the proxy forwards reads only);
    a released proxy (asyncpg detaches it) is returned as it is."""
    return getattr(conn, "_con", None) or conn


def _slots(cls: type) -> set[str]:
    return {name for c in cls.__mro__ for name in getattr(c, "__slots__", ())}


def _adoption_supported() -> bool:
    """Whether asyncpg keeps its transaction where begin_locked_adopted() puts it.

    Two private attributes are involved: ``Connection._top_xact``, the transaction
    asyncpg started (it makes ``conn.transaction()`` a savepoint and lets
    ``Transaction.commit()`` end it), and ``Transaction._state``. asyncpg 0.29 to
    0.32 have both; if a release moves them, pgcoord takes the public path
    (``conn.transaction()``, one more round trip) and
    tests/integration/test_exclusive_internals.py fails to say so.
    """
    return (
        "_top_xact" in _slots(asyncpg.Connection)
        and "_state" in _slots(Transaction)
        and isinstance(getattr(TransactionState, "STARTED", None), TransactionState)
        and callable(getattr(Transaction, "start", None))
    )


_ADOPTABLE = _adoption_supported()


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
    # Pool.release() runs under asyncio.shield inside asyncpg, and with a timeout
    # it terminates a connection whose reset runs past it.
    checkin_bounded_by_driver = True

    def __init__(self, source: Any) -> None:
        self._pool: asyncpg.Pool | None = source if isinstance(source, POOL_TYPES) else None
        self.pooled = self._pool is not None
        self.conn = None if self._pool is not None else source
        # The Connection itself: a pool proxy's methods cost a dispatch each.
        self._raw: Any = None if self.conn is None else _raw(self.conn)
        self._tx: Transaction | None = None
        # The pool's proxy, kept after release: asyncpg detaches it then.
        self._proxy: Any = None

    async def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = self._proxy = await self._pool.acquire()
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
        if tx is not None and getattr(raw, "_top_xact", tx) is tx:
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
            try:
                await self._pool.release(conn, timeout=_aio.CLEANUP_TIMEOUT)
            except Exception as exc:  # the reset failed or timed out: asyncpg terminated it
                log.warning("pgcoord: connection closed, its reset on release failed: %r", exc)

    def sever(self) -> None:
        self._tx = None
        raw = self._raw
        if raw is None:
            return
        if self._pool is not None and self._proxy is not None and _raw(self._proxy) is not raw:
            return  # its release finished meanwhile: it belongs to the pool again
        raw.terminate()  # for a pooled connection this also frees its slot in the pool
