"""``adapt(obj)``: which driver an object belongs to, and how pgcoord uses it.

This is the one place in pgcoord that asks which driver (asyncpg, psycopg,
SQLAlchemy) a pool, engine, connection or driver error belongs to; everything
else asks the ``Adapter`` it returns. A type is looked at once: its class and
bases name their module, and only when one of them is a driver's is that
driver's module of ``_drivers`` imported (it imports the driver), so
``import pgcoord`` imports no driver, and a driver the user lacks is never
imported at all.

An ``Adapter`` holds the facts (``driver``, ``is_async``, ``is_pool``) and the
few things that differ between drivers on objects the user hands over: the
transaction session for a source, one statement on a user's connection, whether
that connection is in a transaction, the driver connection under a SQLAlchemy
one, a pool's capacity, and the dedicated session (that can LISTEN) around a
driver connection. Each driver module subclasses it (``AsyncpgAdapter``,
``PsycopgAdapter``, ``SQLAlchemyAdapter``) and says which of its types are what
(``classify``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from ..errors import UnsupportedConnection

if TYPE_CHECKING:
    from types import ModuleType

    from .protocol import AsyncTxSession, DedicatedSession, Lender, SessionSource, SyncTxSession

__all__ = ["ACCEPTED", "HOLDER_SOURCES", "Adapter", "adapt", "dedicated", "describe", "driver_of",
           "find_adapter", "is_connect_error", "is_pool_timeout"]

ACCEPTED = (
    "asyncpg Pool/Connection, psycopg (Async)ConnectionPool/(Async)Connection, "
    "or SQLAlchemy (Async)Engine/(Async)Connection"
)

HOLDER_SOURCES = "a DSN, an asyncpg Pool, a psycopg AsyncConnectionPool or a SQLAlchemy AsyncEngine"

# The top-level package a class's module belongs to -> the module of ``_drivers``
# that knows it (psycopg-pool's pools are psycopg's).
_PACKAGES = {"asyncpg": "asyncpg", "psycopg": "psycopg", "psycopg_pool": "psycopg",
             "sqlalchemy": "sqlalchemy"}


def describe(obj: object) -> str:
    """``module.QualName`` of ``obj``'s type, for messages."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class Adapter:
    """What pgcoord knows about one type of pool, engine or connection."""

    #: "asyncpg", "psycopg" or "sqlalchemy".
    driver: ClassVar[str]

    __slots__ = ("_session", "cls", "description", "is_async", "is_pool")

    def __init__(self, cls: type, *, is_async: bool, is_pool: bool,
                 session: Callable[[Any], AsyncTxSession | SyncTxSession]) -> None:
        self.cls = cls
        #: True for asyncio objects (used with ``async with``/``await``).
        self.is_async = is_async
        #: True for a pool or an engine, False for a single connection.
        self.is_pool = is_pool
        self.description = f"{cls.__module__}.{cls.__qualname__}"
        self._session = session

    def __repr__(self) -> str:
        kind = ("async " if self.is_async else "sync ") + ("pool" if self.is_pool else "connection")
        return f"<{type(self).__name__} {kind} {self.description}>"

    # -- transaction sessions ---------------------------------------------------------

    def tx_session_async(self, source: Any) -> AsyncTxSession:
        """The transaction session for ``source`` in ``async with``; ``TypeError``
        (saying to use ``with``) for a synchronous source."""
        if not self.is_async:
            raise TypeError(f"{self.description} is synchronous: use `with pgcoord.exclusive(...)`, "
                            "not `async with`")
        return cast("AsyncTxSession", self._session(source))

    def tx_session_sync(self, source: Any) -> SyncTxSession:
        """The transaction session for ``source`` in ``with``; ``TypeError`` (saying to
        use ``async with``) for an asynchronous source."""
        if self.is_async:
            raise TypeError(f"{self.description} is asynchronous: use `async with pgcoord.exclusive(...)`")
        return cast("SyncTxSession", self._session(source))

    # -- a user's own connection --------------------------------------------------------

    async def fetchval_on(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        """Run one ``$n``-parameter statement on the user's async connection
        ``conn``, in whatever transaction it is in; the first column of its first row."""
        raise UnsupportedConnection(f"pgcoord cannot use a {self.description} here")

    def fetchval_on_sync(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        """``fetchval_on`` for a sync connection."""
        raise UnsupportedConnection(f"pgcoord cannot use a {self.description} here")

    def in_transaction(self, conn: Any) -> bool | None:
        """Whether ``conn``'s session is inside a transaction block, as its driver
        last heard from the server; None where pgcoord cannot tell."""
        return None

    def reports_hot_standby(self, conn: Any) -> bool:
        """Whether the server said, at its last answer on the driver connection
        ``conn``, that it is a hot standby (``in_hot_standby``, reported by
        PostgreSQL 14 and later; a pooler may not pass it on: False then)."""
        return False

    def driver_connection(self, conn: Any) -> Any:
        """The driver's own connection under ``conn`` (the asyncpg ``Connection``
        behind a pool's proxy, the DBAPI connection under a SQLAlchemy one); None
        where there is none to have (a SQLAlchemy connection closed or invalidated)."""
        return conn

    # -- pools ----------------------------------------------------------------------------

    def pool_capacity(self, source: Any) -> int | None:
        """The most connections the pool or engine ``source`` can have out at once,
        or None when it sets no bound that pgcoord can read."""
        return None

    # -- dedicated sessions ---------------------------------------------------------------

    def dedicated(self, conn: Any, lender: Lender | None) -> DedicatedSession:
        """The ``DedicatedSession`` around the async driver connection ``conn``,
        given back through ``lender`` (None: pgcoord opened it, and closes it)."""
        raise UnsupportedConnection(f"LockHolder cannot use a {self.cls.__qualname__}")

    def dedicated_source(self, pool: Any) -> SessionSource:
        """Dedicated sessions borrowed from the async pool or engine ``pool``."""
        raise UnsupportedConnection(f"LockHolder cannot use {self.description}; expected {HOLDER_SOURCES}")


# Per type, once: the adapter, or None for a type no driver module claims.
_by_type: dict[type, Adapter | None] = {}


def _package_of(cls: type) -> str | None:
    for base in cls.__mro__:
        found = _PACKAGES.get(base.__module__.partition(".")[0])
        if found is not None:
            return found
    return None


def _driver_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def find_adapter(obj: object) -> Adapter | None:
    """The adapter for ``obj``, or None when no driver pgcoord knows made it."""
    cls = type(obj)
    try:
        return _by_type[cls]
    except KeyError:
        pass
    name = _package_of(cls)
    found: Adapter | None = None if name is None else _driver_module(name).classify(cls)
    _by_type[cls] = found
    return found


def adapt(obj: object) -> Adapter:
    """The adapter for ``obj``; ``UnsupportedConnection`` for an object pgcoord cannot use."""
    found = find_adapter(obj)
    if found is None:
        raise UnsupportedConnection(f"pgcoord cannot use {describe(obj)}; expected {ACCEPTED}")
    return found


def dedicated(conn: Any, lender: Lender | None) -> DedicatedSession:
    """The ``DedicatedSession`` around the async driver connection ``conn`` (asyncpg's
    or psycopg's, also the one under a SQLAlchemy connection)."""
    found = find_adapter(conn)
    if found is None:
        raise UnsupportedConnection(f"LockHolder cannot use a {type(conn).__qualname__}")
    return found.dedicated(conn, lender)


def driver_of(obj: object) -> str | None:
    """"asyncpg", "psycopg" or "sqlalchemy" for an object of one, else None (psycopg2's
    or pg8000's connection under SQLAlchemy, say)."""
    found = find_adapter(obj)
    return None if found is None else found.driver


# -- driver errors ---------------------------------------------------------------------------

def _error_module(exc: BaseException) -> ModuleType | None:
    # An error of a driver means that driver is imported already.
    name = _package_of(type(exc))
    return None if name is None else _driver_module(name)


def is_pool_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` says a pool had no connection to lend in time (asyncio's
    TimeoutError, psycopg-pool's PoolTimeout, SQLAlchemy's TimeoutError)."""
    if isinstance(exc, TimeoutError):
        return True
    module = _error_module(exc)
    return module is not None and bool(module.is_pool_timeout(exc))


def is_connect_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a driver's error for a connection that could not be had, or
    was lost, that carries no SQLSTATE (psycopg's OperationalError)."""
    module = _error_module(exc)
    return module is not None and bool(module.is_connect_error(exc))
