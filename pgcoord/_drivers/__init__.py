"""Choosing the driver adapter for a source object.

Driver modules are imported only when an object of that driver is seen, so
``import pgcoord`` never imports a driver the user lacks.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedConnection
from .base import AsyncTxSession, SyncTxSession

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


def tx_session(source: Any, *, want_async: bool) -> AsyncTxSession | SyncTxSession:
    """A transaction session for ``source``; ``TypeError`` if used with the wrong ``with``."""
    driver = _driver_of(source)
    is_async: bool | None = None
    session: AsyncTxSession | SyncTxSession | None = None
    if driver == "asyncpg":
        from . import asyncpg as mod

        if isinstance(source, mod.POOL_TYPES + mod.CONNECTION_TYPES):
            is_async = True
            if want_async:
                session = mod.AsyncpgSession(source)
    elif driver == "psycopg":
        from . import psycopg as pmod

        if isinstance(source, pmod.ASYNC_POOL_TYPES + pmod.ASYNC_CONNECTION_TYPES):
            is_async = True
            if want_async:
                session = pmod.AsyncPsycopgSession(source)
        elif isinstance(source, pmod.SYNC_POOL_TYPES + pmod.SYNC_CONNECTION_TYPES):
            is_async = False
            if not want_async:
                session = pmod.SyncPsycopgSession(source)
    elif driver == "sqlalchemy":
        from . import sqlalchemy as smod

        if isinstance(source, smod.ASYNC_TYPES):
            is_async = True
            if want_async:
                session = smod.AsyncSQLAlchemySession(source)
        elif isinstance(source, smod.SYNC_TYPES):
            is_async = False
            if not want_async:
                session = smod.SyncSQLAlchemySession(source)
    if session is not None:
        return session
    if is_async is True:
        raise TypeError(
            f"{_describe(source)} is asynchronous: use `async with pgcoord.exclusive(...)`"
        )
    if is_async is False:
        raise TypeError(
            f"{_describe(source)} is synchronous: use `with pgcoord.exclusive(...)`, "
            "not `async with`"
        )
    raise UnsupportedConnection(f"pgcoord cannot use {_describe(source)}; expected {_ACCEPTED}")
