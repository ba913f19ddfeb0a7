"""The transaction session that ``exclusive()``, ``semaphore()`` and a lease's
statements use: one transaction on one connection, of a pool or engine or the
caller's own.

A protocol: each driver module implements it for its pool and connection types
(and names it as a base, so mypy checks that the class keeps it), and the
features are written against it alone. Driver errors pass through unchanged; the
caller maps them by SQLSTATE.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..base import LockStatement


class AsyncTxSession(Protocol):
    #: The driver's own connection object handed to the body of the block.
    conn: Any
    #: True when the connection is checked out of a pool or engine (not the caller's own).
    pooled: bool = False
    #: True when the driver's own give-back already survives cancellation and is
    #: bounded by ``CLEANUP_TIMEOUT`` (closing the connection past it), so pgcoord
    #: need not run it in a task of its own (that costs a task per acquire). Read by
    #: ``release_async`` only: ``release_sync`` never bounds a give-back after a
    #: COMMIT, which does no I/O on a sync connection.
    checkin_bounded_by_driver: bool = False

    @abstractmethod
    async def checkout(self) -> Any: ...

    @abstractmethod
    def in_transaction(self) -> bool: ...

    async def settle(self) -> None:
        """Wait for the answers to every statement already sent on the connection,
        so that ``in_transaction()`` tells the truth; their errors are raised. Only
        a psycopg connection in pipeline mode can have statements unanswered."""
        return None

    @abstractmethod
    def driver_connection(self) -> Any:
        """The driver's connection under ``conn`` once checked out: the asyncpg
        ``Connection`` behind a pool's proxy, the DBAPI connection under a
        SQLAlchemy one, ``conn`` itself for psycopg."""

    @abstractmethod
    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Run one statement in a transaction of its own; its first row, if any."""

    @abstractmethod
    async def begin_locked(self, lock: LockStatement) -> None:
        """Open a transaction and take the lock, in as few round trips as the driver allows."""

    @abstractmethod
    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        """Take the lock inside the caller's transaction; on failure it stays usable."""

    @abstractmethod
    async def commit(self) -> None: ...

    @abstractmethod
    async def rollback(self) -> None: ...

    @abstractmethod
    async def discard(self) -> None:
        """Close the connection: its state is unknown and it must not be reused."""

    @abstractmethod
    async def checkin(self) -> None:
        """Give a checked-out connection back; nothing for a connection we were given."""

    @abstractmethod
    def sever(self) -> None:
        """Cut the connection now, without waiting for anything: a cleanup on it ran
        past its bound. The server ends the session (and its locks) when it sees the
        socket close; the driver sees the connection closed, so a pool drops it. An
        async session is cut from the event loop; a sync one from any thread (the
        watchdog's), so that a statement blocked on it returns with an error."""
