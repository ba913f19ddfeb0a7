"""Choosing the driver adapter for a source object.

Driver modules are imported only when an object of that driver is seen, so
``import pgcoord`` never imports a driver the user lacks.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _aio, _errmap
from ..errors import UnsupportedConnection
from .base import AsyncTxSession, SyncTxSession

log = logging.getLogger("pgcoord")

_ACCEPTED = (
    "asyncpg Pool/Connection, psycopg (Async)ConnectionPool/(Async)Connection, "
    "or SQLAlchemy (Async)Engine/(Async)Connection"
)


def _driver_of(source: object) -> str | None:
    for cls in type(source).__mro__:
        root = cls.__module__.partition(".")[0]
        if root in ("asyncpg", "psycopg", "psycopg_pool", "sqlalchemy"):
            return "psycopg" if root == "psycopg_pool" else root
    return None


def _describe(source: object) -> str:
    cls = type(source)
    return f"{cls.__module__}.{cls.__qualname__}"


def _session_class(source: Any) -> tuple[type[AsyncTxSession] | type[SyncTxSession], bool]:
    """The session class for ``source`` and whether it is asynchronous."""
    found = _by_type.get(type(source))
    if found is None:
        found = _by_type[type(source)] = _classify(source)
    return found


# Classification walks the MRO and may import a driver module: once per type.
_by_type: dict[type, tuple[type[AsyncTxSession] | type[SyncTxSession], bool]] = {}


def _classify(source: Any) -> tuple[type[AsyncTxSession] | type[SyncTxSession], bool]:
    driver = _driver_of(source)
    if driver == "asyncpg":
        from . import asyncpg as amod

        if isinstance(source, amod.POOL_TYPES + amod.CONNECTION_TYPES):
            return amod.AsyncpgSession, True
    elif driver == "psycopg":
        from . import psycopg as pmod

        if isinstance(source, pmod.ASYNC_POOL_TYPES + pmod.ASYNC_CONNECTION_TYPES):
            return pmod.AsyncPsycopgSession, True
        if isinstance(source, pmod.SYNC_POOL_TYPES + pmod.SYNC_CONNECTION_TYPES):
            return pmod.SyncPsycopgSession, False
    elif driver == "sqlalchemy":
        from . import sqlalchemy as smod

        if isinstance(source, smod.ASYNC_TYPES):
            return smod.AsyncSQLAlchemySession, True
        if isinstance(source, smod.SYNC_TYPES):
            return smod.SyncSQLAlchemySession, False
    raise UnsupportedConnection(f"pgcoord cannot use {_describe(source)}; expected {_ACCEPTED}")


def check_source(source: Any, *, need_async: bool = False, background: str | None = None) -> None:
    """Raise now for an object no driver adapter accepts (``UnsupportedConnection``),
    or for a synchronous one where background work needs an async one (``TypeError``).

    ``background`` names a feature that runs statements in the background (renewals,
    concurrent jobs): it is refused a bare connection, which it would share with the
    caller's own statements and transactions (a rollback of the caller's transaction
    would undo a renewal already counted as made)."""
    _, is_async = _session_class(source)
    if need_async and not is_async:
        raise TypeError(
            f"{_describe(source)} is synchronous; this feature runs in the background on "
            "asyncio and needs an async pool or connection"
        )
    if background is not None and is_bare_connection(source):
        raise UnsupportedConnection(
            f"{background} runs statements in the background and cannot share the "
            f"connection {_describe(source)} with its owner; pass a pool or an engine "
            "(asyncpg Pool, psycopg AsyncConnectionPool, SQLAlchemy AsyncEngine)"
        )


def is_bare_connection(source: Any) -> bool:
    """True for a single connection (of any accepted driver), False for a pool or engine."""
    driver = _driver_of(source)
    if driver == "asyncpg":
        from . import asyncpg as amod

        return isinstance(source, amod.CONNECTION_TYPES)
    if driver == "psycopg":
        from . import psycopg as pmod

        return isinstance(source, pmod.ASYNC_CONNECTION_TYPES + pmod.SYNC_CONNECTION_TYPES)
    if driver == "sqlalchemy":
        from . import sqlalchemy as smod

        return not isinstance(source, smod.ENGINE_TYPES)
    return False


def tx_session(source: Any, *, want_async: bool) -> AsyncTxSession | SyncTxSession:
    """A transaction session for ``source``; ``TypeError`` if used with the wrong ``with``."""
    cls, is_async = _session_class(source)
    if is_async and not want_async:
        raise TypeError(
            f"{_describe(source)} is asynchronous: use `async with pgcoord.exclusive(...)`"
        )
    if want_async and not is_async:
        raise TypeError(
            f"{_describe(source)} is synchronous: use `with pgcoord.exclusive(...)`, "
            "not `async with`"
        )
    return cls(source)


async def fetchval_on(conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
    """Run one ``$n``-parameter statement on a user's async connection, in whatever
    transaction it is in; the first column of the first row."""
    module = type(conn).__module__.partition(".")[0]
    if module == "asyncpg":
        return await conn.fetchval(sql, *params)
    if module == "psycopg":
        from .._queries import to_pyformat

        cur = await conn.execute(to_pyformat(sql), params)
        row = await cur.fetchone() if cur.description else None
        return None if row is None else row[0]
    if module == "sqlalchemy":
        from sqlalchemy import text

        from .._queries import to_named
        from .sqlalchemy import named_params

        result = await conn.execute(text(to_named(sql)), named_params(params))
        return result.scalar() if result.returns_rows else None
    raise UnsupportedConnection(f"pgcoord cannot use a {_describe(conn)} here")


def fetchval_on_sync(conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
    """``fetchval_on`` for a psycopg or SQLAlchemy sync connection."""
    module = type(conn).__module__.partition(".")[0]
    if module == "psycopg":
        from .._queries import to_pyformat

        cur = conn.execute(to_pyformat(sql), params)
        row = cur.fetchone() if cur.description else None
        return None if row is None else row[0]
    if module == "sqlalchemy":
        from sqlalchemy import text

        from .._queries import to_named
        from .sqlalchemy import named_params

        result = conn.execute(text(to_named(sql)), named_params(params))
        return result.scalar() if result.returns_rows else None
    raise UnsupportedConnection(f"pgcoord cannot use a {_describe(conn)} here")


def is_async_connection(conn: Any) -> bool:
    """True for asyncpg, psycopg ``AsyncConnection`` and SQLAlchemy ``AsyncConnection``."""
    module = type(conn).__module__.partition(".")[0]
    if module == "asyncpg":
        return True
    if module == "psycopg":
        import psycopg

        return isinstance(conn, psycopg.AsyncConnection)
    if module == "sqlalchemy":
        from sqlalchemy.ext.asyncio import AsyncConnection

        return isinstance(conn, AsyncConnection)
    raise UnsupportedConnection(f"pgcoord cannot use a {_describe(conn)} here")


async def run_statement(source: Any, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """One ``$n``-parameter statement in a transaction of its own, through any async
    source (a pool's connection is checked out and given back); its first row.
    A missing pgcoord schema raises ``SchemaMissing``."""
    session = tx_session(source, want_async=True)
    assert isinstance(session, AsyncTxSession)
    await session.checkout()
    try:
        with _errmap.schema_missing_raised():
            return await session.run_autocommit(sql, params)
    finally:
        await release_async(session, rollback=False)


async def release_async(session: AsyncTxSession, *, rollback: bool) -> None:
    """Roll back (when asked) and give the connection back, within
    ``CLEANUP_TIMEOUT``; past it the connection is cut and left to its pool.

    Raises nothing but the caller's own ``CancelledError`` (if the caller was
    cancelled meanwhile), so that the caller keeps its own outcome: the body's
    exception, or a normal return.
    """
    if not rollback and session.checkin_bounded_by_driver:
        await session.checkin()
        return
    try:
        await _aio.finish_despite_cancel(
            _rollback_and_checkin(session, rollback), bound=_aio.CLEANUP_TIMEOUT,
            on_timeout=session.sever,
        )
    except _aio.CleanupTimeout as exc:
        log.warning("pgcoord: %s; the connection was closed", exc)


async def _rollback_and_checkin(session: AsyncTxSession, rollback: bool) -> None:
    # No timeout in here: the first step runs on the caller's task (see
    # finish_despite_cancel), where a timeout would cancel the caller.
    try:
        if rollback:
            try:
                await session.rollback()
            except BaseException as exc:  # also when abandoned past the bound
                log.warning("pgcoord: discarding the connection after a failed rollback: %r", exc)
                try:
                    await session.discard()
                except Exception as close_exc:
                    log.warning("pgcoord: closing the connection failed too: %r", close_exc)
                if not isinstance(exc, Exception):
                    raise
    finally:
        try:
            await session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)



def release_sync(session: SyncTxSession, *, rollback: bool) -> None:
    """``release_async`` for a sync session: past ``CLEANUP_TIMEOUT`` a watchdog
    shuts the socket down, so that a blocked rollback returns with an error and
    the connection is closed instead of given back.

    Only a rollback is watched (about 12% of a sync lock's time went to the
    watchdog): after a COMMIT the connection is idle, and giving an idle psycopg
    connection back to a psycopg or SQLAlchemy pool does no I/O.
    """
    if not rollback:
        try:
            session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)
        return
    guard = _watchdog.guard(_aio.CLEANUP_TIMEOUT, session.sever)
    try:
        try:
            session.rollback()
        except BaseException as exc:
            log.warning("pgcoord: discarding the connection after a failed rollback: %r", exc)
            _discard_sync(session)
            if not isinstance(exc, Exception):
                raise
    finally:
        if guard.stop():
            log.warning("pgcoord: rollback did not finish within %s s; the connection was closed",
                        _aio.CLEANUP_TIMEOUT)
            _discard_sync(session)
        try:
            session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)


def _discard_sync(session: SyncTxSession) -> None:
    try:
        session.discard()
    except Exception as exc:
        log.warning("pgcoord: closing the connection failed too: %r", exc)


class _Guard:
    """One guarded cleanup: ``action`` runs at the deadline unless ``stop()`` came first."""

    __slots__ = ("_action", "_lock", "done", "fired")

    def __init__(self, action: Callable[[], object]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self.done = self.fired = False

    def fire(self) -> None:
        # Under the lock, so that stop() returns only once the action is over
        # (the connection is not closed under a socket shutdown in progress).
        with self._lock:
            if self.done:
                return
            self.done = self.fired = True
            try:
                self._action()
            except Exception as exc:
                log.warning("pgcoord: cutting a connection failed: %r", exc)

    def stop(self) -> bool:
        """End the guard; whether its action ran."""
        with self._lock:
            self.done = True
            return self.fired


class _Watchdog:
    """One daemon thread for every sync cleanup's deadline: a thread per cleanup
    would cost more than a try-lock that found the lock busy."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Guard]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def guard(self, bound: float, action: Callable[[], object]) -> _Guard:
        guard = _Guard(action)
        deadline = time.monotonic() + bound
        with self._cond:
            first = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._order), guard))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pgcoord-watchdog", daemon=True)
                self._thread.start()
            elif first:
                self._cond.notify()
        return guard

    def _run(self) -> None:
        while True:
            due: list[_Guard] = []
            with self._cond:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    guard = heapq.heappop(self._heap)[2]
                    if not guard.done:
                        due.append(guard)
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            for guard in due:
                guard.fire()


_watchdog = _Watchdog()
