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

import logging
from typing import Any

from sqlalchemy import Connection, Engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncTransaction

from .._core.queries import to_named
from ..errors import UnsupportedConnection
from .adapt import Adapter, driver_of, find_adapter
from .base import ISOLATION_LEVELS, AsyncTxSession, LockStatement, SyncTxSession, begin_and_lock
from .protocol import SessionSource

log = logging.getLogger("pgcoord")

def named_params(params: tuple[Any, ...]) -> dict[str, Any]:
    return {f"p{i}": value for i, value in enumerate(params, start=1)}


class SQLAlchemyAdapter(Adapter):
    driver = "sqlalchemy"
    __slots__ = ()

    async def fetchval_on(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        result = await conn.execute(text(to_named(sql)), named_params(params))
        return result.scalar() if result.returns_rows else None

    def fetchval_on_sync(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        result = conn.execute(text(to_named(sql)), named_params(params))
        return result.scalar() if result.returns_rows else None

    def driver_connection(self, conn: Any) -> Any:
        if self.is_pool:
            return None
        sync = getattr(conn, "sync_connection", conn)  # an AsyncConnection's Connection
        if sync is None or getattr(sync, "invalidated", True) or getattr(sync, "closed", True):
            return None
        return sync.connection.driver_connection

    def in_transaction(self, conn: Any) -> bool | None:
        driver = self.driver_connection(conn)
        found = None if driver is None else find_adapter(driver)
        return None if found is None else found.in_transaction(driver)

    def dedicated_source(self, pool: Any) -> SessionSource:
        if not (self.is_pool and self.is_async):
            return super().dedicated_source(pool)
        from .sqlalchemy_dedicated import SQLAlchemyPoolSessions

        return SQLAlchemyPoolSessions(pool)

    def pool_capacity(self, source: Any) -> int | None:
        from sqlalchemy.pool import AssertionPool, QueuePool, SingletonThreadPool, StaticPool

        if not self.is_pool:
            return None
        pool = getattr(source, "sync_engine", source).pool
        if isinstance(pool, StaticPool | AssertionPool | SingletonThreadPool):
            return 1
        if isinstance(pool, QueuePool):
            # QueuePool keeps max_overflow only in this private attribute (-1:
            # unbounded, also for pool_size=0); test_pool_capacity_of_each_pool_type
            # fails if a SQLAlchemy version keeps it elsewhere. Unknown: no bound.
            overflow = getattr(pool, "_max_overflow", None)
            if isinstance(overflow, int) and overflow >= 0:
                return int(pool.size()) + overflow
        return None


def classify(cls: type) -> Adapter | None:
    for types, is_async, is_pool, session in (
        ((AsyncEngine,), True, True, AsyncSQLAlchemySession),
        ((AsyncConnection,), True, False, AsyncSQLAlchemySession),
        ((Engine,), False, True, SyncSQLAlchemySession),
        ((Connection,), False, False, SyncSQLAlchemySession),
    ):
        if issubclass(cls, types):
            return SQLAlchemyAdapter(cls, is_async=is_async, is_pool=is_pool, session=session)
    return None


def is_pool_timeout(exc: BaseException) -> bool:
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    return isinstance(exc, PoolTimeout)


def is_connect_error(exc: BaseException) -> bool:
    return False  # the driver's own error is under it (``orig``), and is looked at there


def asyncpg_adapter_protocol(adapter_cls: type) -> str | None:
    """How SQLAlchemy's asyncpg adapter class tracks the transaction it began, so
    that pgcoord can hand it the one it opened together with the lock:

    - ``"transaction"`` (SQLAlchemy 2.1): ``_transaction`` alone; the adapter
      begins before a statement when it is None and commits or rolls back when it
      is set.
    - ``"started"`` (SQLAlchemy 2.0): ``_transaction`` and a ``_started`` flag; it
      begins when the flag is False and commits only when it is True. Setting
      ``_transaction`` alone there left the flag False: the body's first statement
      began a savepoint, COMMIT released only that, and the lock, the writes and
      an open transaction stayed on the pooled connection.
    - None: neither; pgcoord lets SQLAlchemy begin (one more round trip).

    Both attributes are private; tests/integration/test_exclusive_internals.py
    fails when the installed SQLAlchemy has neither shape, and the commit checks
    the driver's own transaction status after the adapter's COMMIT.
    """
    try:
        return _protocols[adapter_cls]
    except KeyError:
        pass
    slots = {name for c in adapter_cls.__mro__ for name in getattr(c, "__slots__", ())}
    protocol = None if "_transaction" not in slots else "started" if "_started" in slots else "transaction"
    _protocols[adapter_cls] = protocol
    return protocol


# Per adapter class, once. An adapter whose COMMIT or ROLLBACK left pgcoord's
# transaction open is set to None: it takes SQLAlchemy's own BEGIN from then on.
_protocols: dict[type, str | None] = {}


def _adapter_failed(adapter_cls: type, when: str) -> None:
    _protocols[adapter_cls] = None
    log.error(
        "pgcoord: SQLAlchemy's %s did not end the lock's transaction at %s; pgcoord ended it "
        "itself and lets SQLAlchemy begin its transactions from now on. Please report this "
        "with your SQLAlchemy version.", adapter_cls.__qualname__, when,
    )


def _asyncpg_adapter_message(adapter: Any, lock: LockStatement) -> str | None:
    """``BEGIN; <lock>`` as SQLAlchemy's asyncpg adapter would begin, or None
    when the adapter is not one whose transaction pgcoord knows how to set."""
    protocol = asyncpg_adapter_protocol(type(adapter))
    if protocol is None or adapter._transaction is not None:
        return None
    if protocol == "started" and adapter._started:
        return None
    level = getattr(adapter, "isolation_level", None)
    # "autocommit" still gets a transaction: an xact lock outside one would be
    # released as soon as it was granted.
    isolation = None if level in (None, "autocommit") else str(level).upper().replace("_", " ")
    if isolation is not None and isolation not in ISOLATION_LEVELS:
        return None
    return begin_and_lock(lock, isolation, getattr(adapter, "readonly", False) or None,
                          getattr(adapter, "deferrable", False) or None)


def _still_open(asyncpg_conn: Any) -> bool:
    """Whether the asyncpg connection is still inside a transaction after
    SQLAlchemy's adapter ended it (a closed connection is in none)."""
    return not asyncpg_conn.is_closed() and bool(asyncpg_conn.is_in_transaction())


def _refuse_autocommit(dbapi_conn: Any) -> None:
    """SQLAlchemy opens no transaction on an AUTOCOMMIT connection, and an xact
    lock taken outside one is released at once."""
    if getattr(dbapi_conn, "autocommit", False) is True:
        raise UnsupportedConnection(
            f"this SQLAlchemy connection is in AUTOCOMMIT mode and its driver "
            f"({type(dbapi_conn).__module__}) gives pgcoord no way to open a transaction on it; "
            "use an engine without isolation_level='AUTOCOMMIT', or the asyncpg or psycopg driver"
        )


class _OnConnection:
    """What both SQLAlchemy sessions answer from the Connection they hold and the
    driver's connection under it."""

    conn: Any
    _driver: Any

    def in_transaction(self) -> bool:
        assert self.conn is not None
        return bool(self.conn.in_transaction())

    def driver_connection(self) -> Any:
        return self._driver


class AsyncSQLAlchemySession(_OnConnection, AsyncTxSession):
    def __init__(self, source: AsyncEngine | AsyncConnection) -> None:
        self._engine = source if isinstance(source, AsyncEngine) else None
        self.pooled = self._engine is not None
        self.conn: AsyncConnection | None = None if self._engine else source  # type: ignore[assignment]
        self._tx: AsyncTransaction | None = None
        # The driver's connection and SQLAlchemy's adapter around it.
        self._driver: Any = None
        self._adapter: Any = None
        # psycopg underneath: its autocommit switch, undone after the transaction.
        self._trip: Any = None
        # asyncpg underneath, between sending BEGIN and handing the transaction to
        # SQLAlchemy's adapter: if that fails, only a ROLLBACK sent to it ends it.
        self._unregistered: Any = None
        # asyncpg underneath, once handed to the adapter: pgcoord's own handle on
        # that transaction, to end it if the adapter did not.
        self._adopted: Any = None

    async def checkout(self) -> Any:
        if self._engine is not None:
            self.conn = await self._engine.connect()
        assert self.conn is not None
        try:
            raw = await self.conn.get_raw_connection()
        except BaseException:
            await self.checkin()
            raise
        self._driver, self._adapter = raw.driver_connection, raw.dbapi_connection
        return self.conn

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if driver_of(self._driver) == "psycopg":
            from . import psycopg as pmod

            return await pmod.guard_cancel(self._driver, self._run_autocommit(sql, params),
                                           grace=pmod.CANCEL_GRACE)
        return await self._run_autocommit(sql, params)

    async def _run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        async with self.conn.begin():
            result = await self.conn.execute(text(to_named(sql)), named_params(params))
            row = result.first() if result.returns_rows else None
            return None if row is None else tuple(row)

    async def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._tx = await self.conn.begin()
        driver, adapter = self._driver, self._adapter
        module = driver_of(driver)
        if module == "asyncpg":
            from . import asyncpg as amod

            message = _asyncpg_adapter_message(adapter, lock)
            if message is not None and amod.can_adopt(driver):
                self._unregistered = driver
                tx = await amod.begin_locked_adopted(driver, message)
                adapter._transaction = tx
                if asyncpg_adapter_protocol(type(adapter)) == "started":
                    adapter._started = True
                self._adopted, self._unregistered = tx, None
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
        # Each step is forgotten only once it has succeeded: after a COMMIT that
        # failed, the rollback that follows still has all of them to undo.
        if self._tx is not None:
            await self._tx.commit()
            self._tx = None
        await self._end_driver_transactions("commit")

    async def _end_driver_transactions(self, how: str) -> None:
        """Commit or roll back (``how``) what was opened under SQLAlchemy, on the driver:
        a transaction adopted from the driver connection, then the one-trip one."""
        adopted, self._adopted = self._adopted, None
        if adopted is not None and _still_open(self._driver):
            _adapter_failed(type(self._adapter), how.upper())
            await getattr(adopted, how)()
        if self._trip is not None:  # kept until it ended: a failed COMMIT is rolled back next
            await getattr(self._trip, how)()
            self._trip = None

    async def rollback(self) -> None:
        assert self.conn is not None
        unregistered, self._unregistered = self._unregistered, None
        if unregistered is not None:
            # Outside a transaction ROLLBACK only warns, so it is safe to send
            # even if the BEGIN never arrived.
            await unregistered.execute("ROLLBACK")
        tx, self._tx = self._tx, None
        sync_conn = self.conn.sync_connection
        if tx is not None and (tx.is_active or (
            sync_conn is not None and sync_conn.get_transaction() is tx.sync_transaction
        )):
            # The second case is a COMMIT that failed: SQLAlchemy leaves that
            # transaction inactive but still the connection's, and only its
            # rollback() lets the connection begin again.
            await tx.rollback()
        elif self.conn.in_transaction():
            await self.conn.rollback()  # one the body began after ending ours
        await self._end_driver_transactions("rollback")

    async def discard(self) -> None:
        self._tx = self._trip = self._unregistered = self._adopted = None
        if self.conn is not None:
            await self.conn.invalidate()

    async def checkin(self) -> None:
        if self._engine is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            await conn.close()

    def sever(self) -> None:
        driver = self._driver
        module = driver_of(driver)
        if module == "asyncpg":
            driver.terminate()
        elif module == "psycopg":
            from . import psycopg as pmod

            pmod.sever_async(driver)


class SyncSQLAlchemySession(_OnConnection, SyncTxSession):
    def __init__(self, source: Engine | Connection) -> None:
        self._engine = source if isinstance(source, Engine) else None
        self.pooled = self._engine is not None
        self.conn: Connection | None = None if self._engine else source  # type: ignore[assignment]
        self._tx: Any = None
        self._trip: Any = None
        self._driver: Any = None

    def checkout(self) -> Any:
        if self._engine is not None:
            self.conn = self._engine.connect()
        assert self.conn is not None
        try:
            self._driver = self.conn.connection.driver_connection
        except BaseException:
            self.checkin()
            raise
        return self.conn

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
        driver: Any = self._driver
        if driver_of(driver) == "psycopg":
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
        if self._tx is not None:  # each step forgotten once it succeeded; see the async twin
            self._tx.commit()
            self._tx = None
        if self._trip is not None:
            self._trip.commit()
            self._trip = None

    def rollback(self) -> None:
        assert self.conn is not None
        tx, self._tx = self._tx, None
        if tx is not None and (tx.is_active or self.conn.get_transaction() is tx):
            tx.rollback()  # also closes out a transaction whose COMMIT failed
        elif self.conn.in_transaction():
            self.conn.rollback()  # one the body began after ending ours
        if self._trip is not None:
            self._trip.rollback()
            self._trip = None

    def discard(self) -> None:
        self._tx = self._trip = None
        if self.conn is not None:
            self.conn.invalidate()

    def checkin(self) -> None:
        if self._engine is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            conn.close()

    def sever(self) -> None:
        if driver_of(self._driver) == "psycopg":
            from . import psycopg as pmod

            pmod.sever_sync(self._driver)
