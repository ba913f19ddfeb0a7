"""SQLAlchemy 2: ``AsyncEngine``, ``AsyncConnection``, ``Engine``, ``Connection``.

The body receives the SQLAlchemy connection and may use ``begin_nested()``.

SQLAlchemy's own path to the lock is three round trips (its driver sends BEGIN
before the first statement, then the statement, then COMMIT) and a statement
compilation. Under SQLAlchemy's transaction, pgcoord instead sends ``BEGIN;
<lock>`` straight to the driver connection in one message, the way it does for
a bare asyncpg or psycopg connection, and tells SQLAlchemy's asyncpg adapter
about the transaction so that its COMMIT and ROLLBACK end it. Drivers pgcoord
does not know (psycopg2, pg8000) take the lock through SQLAlchemy; on an
AUTOCOMMIT engine that would release the lock as soon as it was granted, so
pgcoord refuses it there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncTransaction

from .._queries import to_named
from ..errors import UnsupportedConnection
from .base import ISOLATION_LEVELS, AsyncTxSession, LockStatement, SyncTxSession, begin_and_lock

ASYNC_TYPES = (AsyncEngine, AsyncConnection)
SYNC_TYPES = (Engine, Connection)
ENGINE_TYPES = (AsyncEngine, Engine)


def named_params(params: tuple[Any, ...]) -> dict[str, Any]:
    return {f"p{i}": value for i, value in enumerate(params, start=1)}


def _driver_module(driver_conn: Any) -> str:
    return type(driver_conn).__module__.partition(".")[0]


def _asyncpg_adapter_message(adapter: Any, lock: LockStatement) -> str | None:
    """``BEGIN; <lock>`` as SQLAlchemy's asyncpg adapter would begin, or None
    when the adapter is not one whose transaction pgcoord knows how to set."""
    if not hasattr(adapter, "_transaction") or adapter._transaction is not None:
        return None
    level = getattr(adapter, "isolation_level", None)
    # "autocommit" still gets a transaction: an xact lock outside one would be
    # released as soon as it was granted.
    isolation = None if level in (None, "autocommit") else str(level).upper().replace("_", " ")
    if isolation is not None and isolation not in ISOLATION_LEVELS:
        return None
    return begin_and_lock(lock, isolation, getattr(adapter, "readonly", False) or None,
                          getattr(adapter, "deferrable", False) or None)


def _refuse_autocommit(dbapi_conn: Any) -> None:
    """SQLAlchemy opens no transaction on an AUTOCOMMIT connection, and an xact
    lock taken outside one is released at once."""
    if getattr(dbapi_conn, "autocommit", False) is True:
        raise UnsupportedConnection(
            f"this SQLAlchemy connection is in AUTOCOMMIT mode and its driver "
            f"({type(dbapi_conn).__module__}) gives pgcoord no way to open a transaction on it; "
            "use an engine without isolation_level='AUTOCOMMIT', or the asyncpg or psycopg driver"
        )


class AsyncSQLAlchemySession(AsyncTxSession):
    def __init__(self, source: AsyncEngine | AsyncConnection) -> None:
        self._engine = source if isinstance(source, AsyncEngine) else None
        self.conn: AsyncConnection | None = None if self._engine else source  # type: ignore[assignment]
        self._tx: AsyncTransaction | None = None
        # psycopg underneath: its autocommit switch, undone after the transaction.
        self._trip: Any = None
        # asyncpg underneath, between sending BEGIN and handing the transaction to
        # SQLAlchemy's adapter: if that fails, only a ROLLBACK sent to it ends it.
        self._unregistered: Any = None

    async def checkout(self) -> Any:
        if self._engine is not None:
            self.conn = await self._engine.connect()
        return self.conn

    def in_transaction(self) -> bool:
        assert self.conn is not None
        return self.conn.in_transaction()

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        async with self.conn.begin():
            result = await self.conn.execute(text(to_named(sql)), named_params(params))
            row = result.first() if result.returns_rows else None
            return None if row is None else tuple(row)

    async def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx = await self.conn.begin()
        raw = await self.conn.get_raw_connection()
        driver: Any = raw.driver_connection
        adapter: Any = raw.dbapi_connection
        module = _driver_module(driver)
        if module == "asyncpg":
            from . import asyncpg as amod

            message = _asyncpg_adapter_message(adapter, lock)
            if message is not None and amod.can_adopt(driver):
                self._unregistered = driver
                adapter._transaction = await amod.begin_locked_adopted(driver, message)
                self._unregistered = None
                return
        elif module == "psycopg":
            from . import psycopg as pmod

            self._trip = pmod.AsyncOneTrip(driver)
            await self._trip.begin_locked(lock)
            return
        _refuse_autocommit(adapter)
        await self.conn.execute(text(to_named(lock.bound)), named_params(lock.params))

    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        async with self.conn.begin_nested():
            await self.conn.execute(text(to_named(lock.bound)), named_params(lock.params))

    async def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            await tx.commit()
        trip, self._trip = self._trip, None
        if trip is not None:
            await trip.commit()

    async def rollback(self) -> None:
        unregistered, self._unregistered = self._unregistered, None
        if unregistered is not None:
            # Outside a transaction ROLLBACK only warns, so it is safe to send
            # even if the BEGIN never arrived.
            await unregistered.execute("ROLLBACK")
        tx, self._tx = self._tx, None
        if tx is not None and tx.is_active:
            await tx.rollback()
        elif self.conn is not None and self.conn.in_transaction():
            await self.conn.rollback()  # one the body began after ending ours
        trip, self._trip = self._trip, None
        if trip is not None:
            await trip.rollback()

    async def discard(self) -> None:
        self._tx = self._trip = self._unregistered = None
        if self.conn is not None:
            await self.conn.invalidate()

    async def checkin(self) -> None:
        if self._engine is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.close()


class SyncSQLAlchemySession(SyncTxSession):
    def __init__(self, source: Engine | Connection) -> None:
        self._engine = source if isinstance(source, Engine) else None
        self.conn: Connection | None = None if self._engine else source  # type: ignore[assignment]
        self._tx: Any = None
        self._trip: Any = None

    def checkout(self) -> Any:
        if self._engine is not None:
            self.conn = self._engine.connect()
        return self.conn

    def in_transaction(self) -> bool:
        assert self.conn is not None
        return self.conn.in_transaction()

    def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        with self.conn.begin():
            result = self.conn.execute(text(to_named(sql)), named_params(params))
            row = result.first() if result.returns_rows else None
            return None if row is None else tuple(row)

    def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx = self.conn.begin()
        raw = self.conn.connection
        driver: Any = raw.driver_connection
        if _driver_module(driver) == "psycopg":
            from . import psycopg as pmod

            self._trip = pmod.SyncOneTrip(driver)
            self._trip.begin_locked(lock)
            return
        _refuse_autocommit(raw.dbapi_connection)
        self.conn.execute(text(to_named(lock.bound)), named_params(lock.params))

    def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        with self.conn.begin_nested():
            self.conn.execute(text(to_named(lock.bound)), named_params(lock.params))

    def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.commit()
        trip, self._trip = self._trip, None
        if trip is not None:
            trip.commit()

    def rollback(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None and tx.is_active:
            tx.rollback()
        elif self.conn is not None and self.conn.in_transaction():
            self.conn.rollback()  # one the body began after ending ours
        trip, self._trip = self._trip, None
        if trip is not None:
            trip.rollback()

    def discard(self) -> None:
        self._tx = self._trip = None
        if self.conn is not None:
            self.conn.invalidate()

    def checkin(self) -> None:
        if self._engine is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            conn.close()
