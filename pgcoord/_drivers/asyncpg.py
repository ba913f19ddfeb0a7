"""asyncpg: ``Pool``, ``Connection`` and pooled connection proxies.

Its adapter, its transaction session and its dedicated session. asyncpg reads its
socket all the time, so a dedicated session hears of its loss (a termination
listener) and of notifications (``add_listener``) as soon as they arrive.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg
import asyncpg.pool
from asyncpg.transaction import Transaction, TransactionState

from .._core import aio as _aio
from .adapt import Adapter
from .base import AsyncTxSession, LockStatement, begin_and_lock
from .protocol import LEND_TIMEOUT, DedicatedSession, Lender, SessionSource, Unlisten

log = logging.getLogger("pgcoord")

CONNECTION_TYPES = (asyncpg.Connection, asyncpg.pool.PoolConnectionProxy)
POOL_TYPES = (asyncpg.Pool,)


def _raw(conn: Any) -> Any:
    """The real Connection behind a pool proxy (the proxy forwards reads only);
    a released proxy (asyncpg detaches it) is returned as it is."""
    return getattr(conn, "_con", None) or conn


class AsyncpgAdapter(Adapter):
    driver = "asyncpg"
    __slots__ = ()

    def reports_hot_standby(self, conn: Any) -> bool:
        return getattr(_raw(conn).get_settings(), "in_hot_standby", None) == "on"

    async def fetchval_on(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        return await conn.fetchval(sql, *params)

    def in_transaction(self, conn: Any) -> bool | None:
        return bool(conn.is_in_transaction())

    def driver_connection(self, conn: Any) -> Any:
        return _raw(conn)

    def pool_capacity(self, source: Any) -> int | None:
        return int(source.get_max_size()) if self.is_pool else None

    def dedicated(self, conn: Any, lender: Lender | None) -> DedicatedSession:
        if self.is_pool:
            return super().dedicated(conn, lender)
        return AsyncpgDedicated(conn, lender)

    def dedicated_source(self, pool: Any) -> SessionSource:
        if not self.is_pool:
            return super().dedicated_source(pool)
        return AsyncpgPoolSessions(pool)


def classify(cls: type) -> Adapter | None:
    if issubclass(cls, POOL_TYPES):
        return AsyncpgAdapter(cls, is_async=True, is_pool=True, session=AsyncpgSession)
    if issubclass(cls, CONNECTION_TYPES):
        return AsyncpgAdapter(cls, is_async=True, is_pool=False, session=AsyncpgSession)
    return None


def is_pool_timeout(exc: BaseException) -> bool:
    return False  # asyncpg's pool raises asyncio's TimeoutError, which adapt() knows


def is_connect_error(exc: BaseException) -> bool:
    return False


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
        self.conn: Any = None if self._pool is not None else source
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

    def driver_connection(self) -> Any:
        return self._raw

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
            # One simple-protocol message: a wait keeps statement_timeout off itself.
            await self.conn.execute(lock.inline)

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


#: How long close_now() lets a cancel request in flight take before the socket is cut.
CANCEL_SEND_BOUND = 0.5


class AsyncpgDedicated(DedicatedSession):
    """An asyncpg connection as a ``DedicatedSession``."""

    def __init__(self, conn: Any, lender: Lender | None) -> None:
        self.conn = conn
        # The Connection behind a pool's proxy: its methods skip the proxy's dispatch.
        self._raw = _raw(conn)
        self._lender = lender
        self._listeners: list[Callable[[Any], None]] = []

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self._raw.fetchval(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        row = await self._raw.fetchrow(sql, *args)
        return None if row is None else tuple(row)

    async def execute(self, sql: str) -> None:
        await self._raw.execute(sql)

    def on_lost(self, callback: Callable[[], None]) -> None:
        def listener(_conn: Any) -> None:
            callback()

        self._listeners.append(listener)
        self._raw.add_termination_listener(listener)

    async def listen(self, channel: str, callback: Callable[[str], None]) -> Unlisten:
        raw = self._raw

        def on_notify(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            callback(payload)

        await raw.add_listener(channel, on_notify)

        async def unlisten(*, lost: bool = False) -> None:
            # A borrowed connection must go back with no listener of ours (asyncpg's
            # pool warns of one); asyncpg sends UNLISTEN when the last one goes.
            if not lost and not raw.is_closed():
                await raw.remove_listener(channel, on_notify)

        return unlisten

    def _forget_listeners(self) -> None:
        # A pooled connection outlives us: its next user's loss is not ours.
        for listener in self._listeners:
            self._raw.remove_termination_listener(listener)
        self._listeners.clear()

    def announced_pid(self) -> int | None:
        return int(self._raw.get_server_pid())

    def terminate(self) -> None:
        self._raw.terminate()

    async def close_now(self) -> None:
        # A statement whose task was cancelled goes on on the server until asyncpg's
        # cancel request, sent from a task of its own, reaches it; terminate() drops
        # that request, and the server sees the closed socket only at its next client
        # check (never where client_connection_check_interval is 0: an elector's
        # doorbell wait stayed queued until its lock_timeout, a ttl). Let it go out
        # first, briefly (a network that does not answer is not waited for).
        cancels = [t for t in getattr(self._raw, "_cancellations", ()) if not t.done()]
        try:
            if cancels:
                await asyncio.wait(cancels, timeout=CANCEL_SEND_BOUND)
        finally:
            self.terminate()  # cancelled in that wait or not, the connection is closed
        if self._lender is not None:
            await self._lender.discard(self.conn)

    async def give_back(self) -> None:
        self._forget_listeners()
        if self._lender is None:
            await self._raw.close(timeout=5)
        else:
            await self._lender.give_back(self.conn)


class _AsyncpgLender(Lender):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def give_back(self, driver_conn: Any) -> None:
        await self.pool.release(driver_conn)

    async def discard(self, driver_conn: Any) -> None:
        # A terminated connection's holder goes back to the pool, which opens
        # a new connection for the next borrower.
        await self.pool.release(driver_conn)


class AsyncpgPoolSessions(SessionSource):
    """Dedicated sessions borrowed from an asyncpg ``Pool``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._lender = _AsyncpgLender(pool)

    async def open(self) -> DedicatedSession:
        return AsyncpgDedicated(await self.pool.acquire(), self._lender)

    async def open_now(self) -> DedicatedSession | None:
        pool = self.pool
        if pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
            return None
        try:
            conn = await pool.acquire(timeout=LEND_TIMEOUT)
        except TimeoutError:
            return None
        return AsyncpgDedicated(conn, self._lender)
