"""Dedicated connections for LockHolder: opened from a DSN or borrowed from a pool.

A ``HolderConnection`` is one driver connection used outside any transaction
(session locks). A ``ConnectionSource`` opens them: its own connections from a
DSN, or ones borrowed from an asyncpg pool, a psycopg async pool or a SQLAlchemy
async engine, which go back only after the holder proved them clean.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ._queries import query, to_pyformat
from .errors import UnsupportedConnection


class HolderConnection(ABC):
    backend_pid: int = 0

    @abstractmethod
    async def fetchval(self, sql: str, *args: Any) -> Any:
        """One statement with ``$n`` parameters; the first column of its first row."""

    @abstractmethod
    async def execute(self, sql: str) -> None:
        """Parameterless SQL, possibly several statements (simple protocol)."""

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """Make a fresh or borrowed connection fit for session locks."""

    def on_lost(self, callback: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Call ``callback`` as soon as the driver sees the connection close."""

    @abstractmethod
    async def close_now(self) -> None:
        """Drop the connection at once; never waits on the network."""

    @abstractmethod
    async def give_back(self) -> None:
        """Return a borrowed connection to its pool, or close an owned one."""


class _Asyncpg(HolderConnection):
    def __init__(self, conn: Any, give_back: Callable[[Any], Any] | None) -> None:
        self.conn = conn
        self._give_back = give_back

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self.conn.fetchval(sql, *args)

    async def execute(self, sql: str) -> None:
        await self.conn.execute(sql)

    def on_lost(self, callback: Callable[[], None]) -> None:
        self.conn.add_termination_listener(lambda _conn: callback())

    async def close_now(self) -> None:
        self.conn.terminate()

    async def give_back(self) -> None:
        if self._give_back is None:
            await self.conn.close(timeout=5)
        else:
            await self._give_back(self.conn)


class _Psycopg(HolderConnection):
    def __init__(self, conn: Any, give_back: Callable[[Any], Any] | None) -> None:
        self.conn = conn
        self._give_back = give_back
        self._restore_autocommit = False

    async def prepare(self) -> None:
        # Session locks are taken outside transactions: a pooled connection
        # without autocommit gets it for the holder's lifetime.
        if not self.conn.autocommit:
            await self.conn.set_autocommit(True)
            self._restore_autocommit = True

    async def fetchval(self, sql: str, *args: Any) -> Any:
        cur = await self.conn.execute(to_pyformat(sql), args or None)
        row = await cur.fetchone()
        return None if row is None else row[0]

    async def execute(self, sql: str) -> None:
        await self.conn.execute(sql)

    async def close_now(self) -> None:
        await self.conn.close()

    async def give_back(self) -> None:
        if self._restore_autocommit and not self.conn.closed:
            await self.conn.set_autocommit(False)
        if self._give_back is None:
            await self.conn.close()
        else:
            await self._give_back(self.conn)


def _wrap(driver_conn: Any, give_back: Callable[[Any], Any] | None) -> HolderConnection:
    module = type(driver_conn).__module__.partition(".")[0]
    if module == "asyncpg":
        return _Asyncpg(driver_conn, give_back)
    if module == "psycopg":
        return _Psycopg(driver_conn, give_back)
    raise UnsupportedConnection(f"LockHolder cannot use a {type(driver_conn).__qualname__}")


class ConnectionSource(ABC):
    @abstractmethod
    async def open(self) -> HolderConnection: ...


class DsnSource(ConnectionSource):
    def __init__(self, dsn: str, driver: str | None, keepalive: float) -> None:
        if driver is None:
            driver = next(
                (d for d in ("asyncpg", "psycopg") if importlib.util.find_spec(d) is not None), None
            )
            if driver is None:
                raise UnsupportedConnection("LockHolder(dsn) needs asyncpg or psycopg installed")
        if driver not in ("asyncpg", "psycopg"):
            raise ValueError(f"driver must be 'asyncpg' or 'psycopg', not {driver!r}")
        self.dsn, self.driver, self.keepalive = dsn, driver, keepalive

    async def open(self) -> HolderConnection:
        if self.driver == "asyncpg":
            import asyncpg

            return _Asyncpg(await asyncpg.connect(self.dsn), None)
        import psycopg

        idle = max(1, int(self.keepalive / 2))
        conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, keepalives=1, keepalives_idle=idle,
            keepalives_interval=max(1, idle // 2), keepalives_count=3,
            tcp_user_timeout=int(self.keepalive * 1000),
        )
        return _Psycopg(conn, None)


class AsyncpgPoolSource(ConnectionSource):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def open(self) -> HolderConnection:
        return _Asyncpg(await self.pool.acquire(), self.pool.release)


class PsycopgPoolSource(ConnectionSource):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def open(self) -> HolderConnection:
        return _Psycopg(await self.pool.getconn(), self.pool.putconn)


class SQLAlchemySource(ConnectionSource):
    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def open(self) -> HolderConnection:
        sa_conn = await self.engine.connect()
        try:
            raw = await sa_conn.get_raw_connection()

            async def give_back(_driver_conn: Any) -> None:
                await sa_conn.close()

            return _wrap(raw.driver_connection, give_back)
        except BaseException:
            await sa_conn.invalidate()
            await sa_conn.close()
            raise


def connection_source(source: Any, driver: str | None, keepalive: float) -> ConnectionSource:
    """The ``ConnectionSource`` for what a user handed to ``LockHolder``."""
    if isinstance(source, str):
        if "://" not in source and "=" not in source:
            raise ValueError("LockHolder needs a DSN (postgresql://...) or a pool")
        return DsnSource(source, driver, keepalive)
    if driver is not None:
        raise ValueError("driver= is only for a DSN; a pool already has its driver")
    modules = {cls.__module__.partition(".")[0] for cls in type(source).__mro__}
    if "asyncpg" in modules:
        import asyncpg

        if isinstance(source, asyncpg.Pool):
            return AsyncpgPoolSource(source)
    if "psycopg_pool" in modules:
        import psycopg_pool

        if isinstance(source, psycopg_pool.AsyncConnectionPool):
            return PsycopgPoolSource(source)
    if "sqlalchemy" in modules:
        from sqlalchemy.ext.asyncio import AsyncEngine

        if isinstance(source, AsyncEngine):
            return SQLAlchemySource(source)
    raise UnsupportedConnection(
        f"LockHolder cannot use {type(source).__module__}.{type(source).__qualname__}; expected "
        "a DSN, an asyncpg Pool, a psycopg AsyncConnectionPool or a SQLAlchemy AsyncEngine"
    )


async def behind_transaction_pooler(source: ConnectionSource, conn: HolderConnection) -> bool:
    """Whether ``conn`` reaches the server through a transaction-mode pooler.

    Behind PgBouncer in transaction mode a client's statements may run on
    different server sessions, and an idle client's server session is handed
    to the next client. So: ask a second client from the same source for its
    server pid, then ask ``conn`` again. The pid must stay put, and must not be
    the one the second client got. ``conn.backend_pid`` must already be set.
    """
    other = await source.open()
    try:
        await other.prepare()
        # Other clients of the pooler may be busy at the same moment and change
        # which server session each of ours gets; a few rounds make that moot.
        # Directly or in session mode no round can ever look pooled.
        for _ in range(3):
            other_pid = int(await other.fetchval(query("holder_backend_pid")))
            again = int(await conn.fetchval(query("holder_backend_pid")))
            if again != conn.backend_pid or other_pid == conn.backend_pid:
                return True
        return False
    finally:
        await other.give_back()
