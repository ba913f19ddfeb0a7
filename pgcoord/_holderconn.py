"""Dedicated connections for LockHolder, Elector and Member: opened from a DSN or
borrowed from a pool.

A ``HolderConnection`` is one driver connection used outside any transaction
(session locks, a lease's doorbell). It tells its owner as soon as the server
closes it (``on_lost``): asyncpg reads its socket all the time; for psycopg,
which reads only while a statement runs, the socket is watched while the
connection is idle (see ``_holderpsycopg``).

A ``ConnectionSource`` opens them: its own connections from a DSN, or ones
borrowed from an asyncpg pool, a psycopg async pool or a SQLAlchemy async
engine, which go back only after their owner proved them clean, and go back
*broken* (so the pool replaces them) when they were discarded.

``open()`` may wait as any borrower of the pool would (the pool's own timeout
becomes ``PoolExhausted``). ``open_now()`` gives another connection only if one
can be had at once: a DSN source opens one; a pool lends one only when it has
one idle or room to open one, and the answer is None otherwise. pgcoord takes
every connection beyond the first with ``open_now()``, so it never waits on a
pool for a connection it itself holds (with ``max_size=1`` that wait could
never end).
"""

from __future__ import annotations

import asyncio
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from ._dsnhosts import asyncpg_connect, psycopg_connect_timeout
from ._queries import query
from .errors import PoolExhausted, UnsupportedConnection

# How long open_now() lets a pool take to lend a connection it said it had (the
# pool may have to open it). Past it, the borrower gets PoolExhausted.
LEND_TIMEOUT = 10.0


class HolderConnection(ABC):
    #: The server process of this session (set by the owner after its setup).
    backend_pid: int = 0
    #: The driver's own connection object.
    conn: Any

    @abstractmethod
    async def fetchval(self, sql: str, *args: Any) -> Any:
        """One statement with ``$n`` parameters; the first column of its first row."""

    @abstractmethod
    async def fetchrow(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        """One statement with ``$n`` parameters; its first row."""

    @abstractmethod
    async def execute(self, sql: str) -> None:
        """Parameterless SQL, possibly several statements (simple protocol)."""

    async def execute_blocking(self, sql: str) -> None:
        """``execute()`` for a statement that may wait for long (a lock wait).
        Where the driver cannot cancel a statement without blocking the event
        loop (psycopg < 3.2), cancelling this one closes the connection at once
        instead of first giving it time to end by itself."""
        await self.execute(sql)

    async def prepare(self) -> None:  # noqa: B027 - optional hook
        """Make a fresh or borrowed connection fit for session locks."""

    def on_lost(self, callback: Callable[[], None]) -> None:  # noqa: B027 - optional hook
        """Call ``callback`` as soon as the driver sees the connection close."""

    @abstractmethod
    def announced_pid(self) -> int | None:
        """The process id the server announced when the connection was made
        (BackendKeyData). A pooler announces one of its own."""

    @abstractmethod
    def terminate(self) -> None:
        """Close the connection at our end at once: never blocks, never waits on
        the network. The server ends the session (and releases its locks) when it
        sees the socket close, and a statement in flight fails at once. Safe to
        call twice and during a statement."""

    def abort(self) -> None:
        """``terminate()`` for when the statement in flight, if any, is being
        cancelled (the ``on_timeout`` of a cleanup whose statement runs past its
        bound): its wait is woken by the cancellation, so the socket can be
        closed under it at once."""
        self.terminate()

    @abstractmethod
    async def close_now(self) -> None:
        """``terminate()``, then tell the pool (if borrowed) that the connection
        is gone so it frees the slot. Never waits on the network."""

    @abstractmethod
    async def give_back(self) -> None:
        """Return a borrowed connection to its pool, or close an owned one."""


class Lender:
    """How a borrowed connection goes back: as good, or as broken."""

    async def give_back(self, driver_conn: Any) -> None:
        raise NotImplementedError

    async def discard(self, driver_conn: Any) -> None:
        """The connection is closed at our end already; free its slot."""
        raise NotImplementedError


# -- asyncpg ---------------------------------------------------------------------------

def _raw_asyncpg(conn: Any) -> Any:
    """The Connection behind a pool's proxy: its methods skip the proxy's dispatch."""
    import asyncpg

    raw = getattr(conn, "_con", None)
    return raw if isinstance(raw, asyncpg.Connection) else conn


class _Asyncpg(HolderConnection):
    def __init__(self, conn: Any, lender: Lender | None) -> None:
        self.conn = conn
        self._raw = _raw_asyncpg(conn)
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
        self.terminate()
        if self._lender is not None:
            await self._lender.discard(self.conn)

    async def give_back(self) -> None:
        self._forget_listeners()
        if self._lender is None:
            await self._raw.close(timeout=5)
        else:
            await self._lender.give_back(self.conn)


# -- psycopg ---------------------------------------------------------------------------

def _wrap(driver_conn: Any, lender: Lender | None) -> HolderConnection:
    module = type(driver_conn).__module__.partition(".")[0]
    if module == "asyncpg":
        return _Asyncpg(driver_conn, lender)
    if module == "psycopg":
        from ._holderpsycopg import PsycopgConnection

        return PsycopgConnection(driver_conn, lender)
    raise UnsupportedConnection(f"LockHolder cannot use a {type(driver_conn).__qualname__}")


# -- sources ---------------------------------------------------------------------------

class ConnectionSource(ABC):
    @abstractmethod
    async def open(self) -> HolderConnection:
        """A connection, waiting for it as any borrower of the pool would."""

    @abstractmethod
    async def open_now(self) -> HolderConnection | None:
        """A connection if one can be had without waiting for another borrower
        to give one back; None otherwise."""


class DsnSource(ConnectionSource):
    def __init__(self, dsn: str, driver: str | None, keepalive: float) -> None:
        # asyncpg reads only URLs; libpq (psycopg) also reads key=value strings, such as
        # the multi-host "host=a,b port=5432,5432 target_session_attrs=read-write".
        is_url = "://" in dsn
        if driver is None:
            driver = next(
                (d for d in (("asyncpg", "psycopg") if is_url else ("psycopg",))
                 if importlib.util.find_spec(d) is not None), None
            )
            if driver is None:
                raise UnsupportedConnection(
                    "LockHolder(dsn) needs asyncpg or psycopg installed" if is_url else
                    "a key=value DSN needs psycopg installed (asyncpg reads only postgresql:// URLs)")
        if driver not in ("asyncpg", "psycopg"):
            raise ValueError(f"driver must be 'asyncpg' or 'psycopg', not {driver!r}")
        if driver == "asyncpg" and not is_url:
            raise ValueError("asyncpg reads only postgresql:// URLs, not key=value DSNs: pass the "
                             "URL form (postgresql://user@host1:5432,host2:5432/db?...) or driver='psycopg'")
        self.dsn, self.driver, self.keepalive = dsn, driver, keepalive

    async def open(self) -> HolderConnection:
        if self.driver == "asyncpg":
            return _wrap(await asyncpg_connect(self.dsn, self.keepalive), None)
        import psycopg

        idle = max(1, int(self.keepalive / 2))
        conn = await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, keepalives=1, keepalives_idle=idle,
            keepalives_interval=max(1, idle // 2), keepalives_count=3,
            tcp_user_timeout=int(self.keepalive * 1000),
            **psycopg_connect_timeout(self.dsn, self.keepalive),
        )
        return _wrap(conn, None)

    async def open_now(self) -> HolderConnection:
        return await self.open()


class _AsyncpgLender(Lender):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def give_back(self, driver_conn: Any) -> None:
        await self.pool.release(driver_conn)

    async def discard(self, driver_conn: Any) -> None:
        # A terminated connection's holder goes back to the pool, which opens
        # a new connection for the next borrower.
        await self.pool.release(driver_conn)


class AsyncpgPoolSource(ConnectionSource):
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._lender = _AsyncpgLender(pool)

    async def open(self) -> HolderConnection:
        return _wrap(await self.pool.acquire(), self._lender)

    async def open_now(self) -> HolderConnection | None:
        pool = self.pool
        if pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size():
            return None
        try:
            conn = await pool.acquire(timeout=LEND_TIMEOUT)
        except TimeoutError:
            return None
        return _wrap(conn, self._lender)


class _PsycopgLender(Lender):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def give_back(self, driver_conn: Any) -> None:
        await self.pool.putconn(driver_conn)

    async def discard(self, driver_conn: Any) -> None:
        # putconn() sees a closed connection, drops it and opens a replacement.
        await self.pool.putconn(driver_conn)


class PsycopgPoolSource(ConnectionSource):
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._lender = _PsycopgLender(pool)

    async def open(self) -> HolderConnection:
        import psycopg_pool

        try:
            conn = await self.pool.getconn()
        except psycopg_pool.PoolTimeout as exc:
            raise PoolExhausted(
                f"the psycopg pool lent no connection to LockHolder within its timeout: {exc}"
            ) from exc
        return _wrap(conn, self._lender)

    async def open_now(self) -> HolderConnection | None:
        import psycopg_pool

        pool = self.pool
        stats = pool.get_stats()
        if stats.get("pool_available", 0) == 0 and stats.get("pool_size", 0) >= pool.max_size:
            return None
        try:
            conn = await pool.getconn(timeout=LEND_TIMEOUT)
        except psycopg_pool.PoolTimeout:
            return None
        return _wrap(conn, self._lender)


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


class SQLAlchemySource(ConnectionSource):
    def __init__(self, engine: Any) -> None:
        from sqlalchemy.pool import SingletonThreadPool, StaticPool

        if isinstance(engine.pool, StaticPool | SingletonThreadPool):
            raise UnsupportedConnection(
                f"LockHolder cannot use an engine with a {type(engine.pool).__name__}: it hands "
                "the same connection to every borrower, so session locks would be shared with "
                "them; use the default pool or NullPool"
            )
        self.engine = engine

    async def open(self) -> HolderConnection:
        from sqlalchemy.exc import TimeoutError as SATimeout

        try:
            sa_conn = await self.engine.connect()
        except SATimeout as exc:
            raise PoolExhausted(
                f"the SQLAlchemy pool lent no connection to LockHolder within its timeout: {exc}"
            ) from exc
        return await self._adopt(sa_conn)

    def _can_lend_now(self) -> bool:
        from sqlalchemy.pool import NullPool, QueuePool

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

    async def open_now(self) -> HolderConnection | None:
        from sqlalchemy.exc import TimeoutError as SATimeout

        if not self._can_lend_now():
            return None
        try:
            async with asyncio.timeout(LEND_TIMEOUT):
                sa_conn = await self.engine.connect()
        except (TimeoutError, SATimeout):
            return None
        return await self._adopt(sa_conn)

    async def _adopt(self, sa_conn: Any) -> HolderConnection:
        try:
            raw = await sa_conn.get_raw_connection()
            return _wrap(raw.driver_connection, _SQLAlchemyLender(sa_conn))
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

    First, on ``conn`` alone: the server announces its process id when the
    connection is made, and ``pg_backend_pid()`` reports the process that runs
    the session. When the two agree nothing between us switches server sessions
    (a pooler announces an id of its own), and no other connection is needed.
    ``conn.backend_pid`` must already be set.

    When they differ a pooler is in between, and only its mode matters: behind
    PgBouncer in transaction mode a client's statements may run on different
    server sessions, and an idle client's server session is handed to the next
    client. So a second client from the same source asks for its server pid,
    then ``conn`` asks again: the pid must stay put, and must not be the one the
    second client got. The second client is taken with ``open_now()``; a pool
    that has none to lend at once gets ``UnsupportedConnection`` (it cannot be
    told from a transaction-mode one), never a wait on the pool.
    """
    if conn.announced_pid() == conn.backend_pid:
        return False
    other = await source.open_now()
    if other is None:
        raise UnsupportedConnection(
            "there is a pooler between this pool and the server (the server process that runs "
            "the session is not the one announced at connect), and telling a session-mode "
            "pooler from a transaction-mode one needs a second connection for a moment, which "
            "the pool had none of to lend: give the pool room for one more connection, or "
            "pass a DSN"
        )
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
