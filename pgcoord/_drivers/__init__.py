"""The driver seam: what pgcoord needs from asyncpg, psycopg and SQLAlchemy.

- ``adapt(obj)`` (``adapt.py``) is the one place that asks which driver an object
  belongs to; the rest of pgcoord asks the ``Adapter`` it returns.
- ``protocol.py``: the transaction session and the dedicated session, as protocols
  the driver modules implement.
- ``dsn.py``: the one rule for which driver opens a DSN, and how.
- ``asyncpg.py``, ``psycopg.py`` (+ ``psycopg_dedicated.py``), ``sqlalchemy.py``:
  the implementations, each imported only when an object of its driver is seen, so
  ``import pgcoord`` never imports a driver the user lacks.
"""

from __future__ import annotations

from typing import Any

from .._core import errmap as _errmap
from .._core.aio import Backoff
from ..errors import UnsupportedConnection
from .adapt import Adapter as Adapter
from .adapt import adapt as adapt
from .adapt import describe as _describe
from .adapt import driver_of as driver_of
from .adapt import find_adapter as find_adapter
from .protocol import AsyncTxSession, SyncTxSession
from .release import bounded_async as bounded_async
from .release import bounded_sync as bounded_sync
from .release import release_async as release_async
from .release import release_sync as release_sync

__all__ = [
    "Adapter", "adapt", "autocommit_retrying", "bounded_async", "bounded_sync", "check_source",
    "driver_of", "fetchval_on",
    "fetchval_on_sync", "find_adapter", "release_async", "release_sync", "reports_hot_standby",
    "run_statement",
    "tx_session_async", "tx_session_sync",
]


def check_source(source: Any, *, need_async: bool = False, background: str | None = None) -> None:
    """Raise now for an object no driver adapter accepts (``UnsupportedConnection``),
    or for a synchronous one where background work needs an async one (``TypeError``).

    ``background`` names a feature that runs statements in the background (renewals,
    concurrent jobs): it is refused a bare connection, which it would share with the
    caller's own statements and transactions (a rollback of the caller's transaction
    would undo a renewal already counted as made)."""
    adapter = adapt(source)
    if need_async and not adapter.is_async:
        raise TypeError(
            f"{_describe(source)} is synchronous; this feature runs in the background on "
            "asyncio and needs an async pool or connection"
        )
    if background is not None and not adapter.is_pool:
        raise UnsupportedConnection(
            f"{background} runs statements in the background and cannot share the "
            f"connection {_describe(source)} with its owner; pass a pool or an engine "
            "(asyncpg Pool, psycopg AsyncConnectionPool, SQLAlchemy AsyncEngine)"
        )


def tx_session_async(source: Any) -> AsyncTxSession:
    """``tx_session`` for ``async with`` (generated sync code calls ``tx_session_sync``)."""
    return adapt(source).tx_session_async(source)


def tx_session_sync(source: Any) -> SyncTxSession:
    """``tx_session`` for ``with``."""
    return adapt(source).tx_session_sync(source)


async def fetchval_on(conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
    """Run one ``$n``-parameter statement on a user's async connection, in whatever
    transaction it is in; the first column of the first row."""
    return await adapt(conn).fetchval_on(conn, sql, params)


def reports_hot_standby(conn: Any) -> bool:
    """Whether the server said, at its last answer on the driver connection ``conn``
    (a session's ``driver_connection()``), that it is a hot standby; no I/O.

    Also for the drivers SQLAlchemy brings that pgcoord has no adapter for: psycopg2
    (``get_parameter_status``) and pg8000 (``parameter_statuses``)."""
    if conn is None:
        return False
    found = find_adapter(conn)
    if found is not None:
        return found.reports_hot_standby(conn)
    get_status = getattr(conn, "get_parameter_status", None)
    if callable(get_status):
        return bool(get_status("in_hot_standby") == "on")
    statuses = getattr(conn, "parameter_statuses", None)
    return isinstance(statuses, dict) and statuses.get("in_hot_standby") == "on"


def fetchval_on_sync(conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
    """``fetchval_on`` for a psycopg or SQLAlchemy sync connection."""
    return adapt(conn).fetchval_on_sync(conn, sql, params)


async def run_statement(source: Any, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """One ``$n``-parameter statement in a transaction of its own, through any async
    source (a pool's connection is checked out and given back); its first row.
    A missing pgcoord schema raises ``SchemaMissing``. A pooled connection the
    server had ended for idle_session_timeout (the statement never ran) is
    replaced by another, once per connection the pool may hold."""
    from .capacity import pool_capacity

    tries = min(max(2, (pool_capacity(source) or 1) + 1), 12)
    for n in range(tries):
        session = tx_session_async(source)
        await session.checkout()
        try:
            with _errmap.schema_missing_raised():
                return await autocommit_retrying(session, sql, params)
        except Exception as exc:
            if not (session.pooled and _errmap.ended_while_idle(exc)) or n + 1 == tries:
                raise
        finally:
            await release_async(session, rollback=False)
    raise AssertionError("unreachable")


#: Tries of one statement of pgcoord's own in a transaction of its own that the
#: server rolls back for serializability (default_transaction_isolation =
#: serializable for the database or role, with others writing the same rows).
SERIALIZATION_TRIES = 12


async def autocommit_retrying(
    session: AsyncTxSession, sql: str, params: tuple[Any, ...],
) -> tuple[Any, ...] | None:
    """``session.run_autocommit``, run again after a short jittered pause when the
    server rolled it back as a serialization failure (it then had no effect)."""
    backoff = Backoff(first=0.005, cap=0.2)
    for n in range(SERIALIZATION_TRIES):
        try:
            return await session.run_autocommit(sql, params)
        except Exception as exc:
            if n + 1 == SERIALIZATION_TRIES or not _errmap.serialization_failure(exc):
                raise
            backoff.failed()
            await backoff.sleep()
    raise AssertionError("unreachable")
