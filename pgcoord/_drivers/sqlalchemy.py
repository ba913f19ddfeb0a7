"""SQLAlchemy 2: ``AsyncEngine``, ``AsyncConnection``, ``Engine``, ``Connection``.

The body receives the SQLAlchemy connection and may use ``begin_nested()``.
Statements go through ``exec_driver_sql`` so the DBAPI sees them unchanged.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncTransaction

from .._queries import to_named
from .base import AsyncTxSession, LockStatement, SyncTxSession

ASYNC_TYPES = (AsyncEngine, AsyncConnection)
SYNC_TYPES = (Engine, Connection)


def _named_params(params: tuple[Any, ...]) -> dict[str, Any]:
    return {f"p{i}": value for i, value in enumerate(params, start=1)}


class AsyncSQLAlchemySession(AsyncTxSession):
    def __init__(self, source: AsyncEngine | AsyncConnection) -> None:
        self._engine = source if isinstance(source, AsyncEngine) else None
        self.conn: AsyncConnection | None = None if self._engine else source  # type: ignore[assignment]
        self._tx: AsyncTransaction | None = None

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
            result = await self.conn.execute(text(to_named(sql)), _named_params(params))
            row = result.first() if result.returns_rows else None
            return None if row is None else tuple(row)

    async def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx = await self.conn.begin()
        await self.conn.execute(text(to_named(lock.bound)), _named_params(lock.params))

    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        async with self.conn.begin_nested():
            await self.conn.execute(text(to_named(lock.bound)), _named_params(lock.params))

    async def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            await tx.commit()

    async def rollback(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            await tx.rollback()

    async def discard(self) -> None:
        self._tx = None
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
            result = self.conn.execute(text(to_named(sql)), _named_params(params))
            row = result.first() if result.returns_rows else None
            return None if row is None else tuple(row)

    def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx = self.conn.begin()
        self.conn.execute(text(to_named(lock.bound)), _named_params(lock.params))

    def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        with self.conn.begin_nested():
            self.conn.execute(text(to_named(lock.bound)), _named_params(lock.params))

    def commit(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.commit()

    def rollback(self) -> None:
        tx, self._tx = self._tx, None
        if tx is not None:
            tx.rollback()

    def discard(self) -> None:
        self._tx = None
        if self.conn is not None:
            self.conn.invalidate()

    def checkin(self) -> None:
        if self._engine is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            conn.close()
