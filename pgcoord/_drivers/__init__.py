"""Choosing the driver adapter for a source object.

Driver modules are imported only when an object of that driver is seen, so
``import pgcoord`` never imports a driver the user lacks.
"""

from __future__ import annotations

from typing import Any

from .. import _errmap
from ..errors import UnsupportedConnection
from .base import AsyncTxSession, SyncTxSession
from .release import bounded_async as bounded_async
from .release import bounded_sync as bounded_sync
from .release import release_async as release_async
from .release import release_sync as release_sync

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


def tx_session_async(source: Any) -> AsyncTxSession:
    """``tx_session`` for ``async with`` (generated sync code calls ``tx_session_sync``)."""
    session = tx_session(source, want_async=True)
    assert isinstance(session, AsyncTxSession)
    return session


def tx_session_sync(source: Any) -> SyncTxSession:
    """``tx_session`` for ``with``."""
    session = tx_session(source, want_async=False)
    assert isinstance(session, SyncTxSession)
    return session


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
