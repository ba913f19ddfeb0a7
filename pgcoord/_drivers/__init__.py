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


def check_source(source: Any) -> None:
    """Raise ``UnsupportedConnection`` now for an object no driver adapter accepts."""
    _session_class(source)


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
