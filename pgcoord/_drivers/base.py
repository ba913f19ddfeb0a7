"""What ``exclusive()`` needs from a driver: one transaction on one connection.

Each driver module implements these for its pool and connection types. A
session checks a connection out (or uses the one it was given), takes the lock
either by opening a transaction or by joining the caller's one inside a
savepoint, and ends or discards it. Driver errors pass through unchanged; the
caller maps them by SQLSTATE.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from .._queries import query


@dataclass(frozen=True, slots=True)
class LockStatement:
    """One lock statement in the two spellings drivers prefer.

    ``inline`` has the key written in, for one simple-protocol message (asyncpg
    sends it together with BEGIN). ``bound`` takes the key as ``$1`` where the
    statement allows parameters, so drivers that prepare repeated statements
    reuse one plan; DO blocks take none, and then ``bound == inline``.
    """

    inline: str
    bound: str
    params: tuple[int, ...]


ISOLATION_LEVELS = frozenset({"READ UNCOMMITTED", "READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"})


@functools.lru_cache(maxsize=4096)
def begin_and_lock(
    lock: LockStatement, isolation: str | None = None, read_only: bool | None = None,
    deferrable: bool | None = None,
) -> str:
    """BEGIN and the lock as one simple-protocol message: one round trip for both.

    The BEGIN carries the transaction characteristics the driver would have
    given its own BEGIN (``isolation`` is spelled as in SQL, "REPEATABLE READ"),
    so taking the lock this way changes nothing the body can observe.
    """
    mode = ""
    if isolation is not None:
        if isolation not in ISOLATION_LEVELS:
            raise ValueError(f"unknown isolation level {isolation!r}")
        mode += f" ISOLATION LEVEL {isolation}"
    if read_only is not None:
        mode += " READ ONLY" if read_only else " READ WRITE"
    if deferrable is not None:
        mode += " DEFERRABLE" if deferrable else " NOT DEFERRABLE"
    return query("begin_and_lock").format(mode=mode, lock=lock.inline)


class AsyncTxSession(ABC):
    #: The driver's own connection object handed to the ``async with`` body.
    conn: Any
    #: True when the connection is checked out of a pool or engine (not the caller's own).
    pooled: bool = False
    #: True when the driver's own give-back already survives cancellation and is
    #: bounded by ``CLEANUP_TIMEOUT`` (closing the connection past it), so pgcoord
    #: need not run it in a task of its own (that costs a task per acquire).
    checkin_bounded_by_driver: bool = False

    @abstractmethod
    def __init__(self, source: Any) -> None: ...

    @abstractmethod
    async def checkout(self) -> Any: ...

    @abstractmethod
    def in_transaction(self) -> bool: ...

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
        socket close; the driver sees the connection closed, so a pool drops it."""


class SyncTxSession(ABC):
    conn: Any
    pooled: bool = False

    @abstractmethod
    def __init__(self, source: Any) -> None: ...

    @abstractmethod
    def checkout(self) -> Any: ...

    @abstractmethod
    def in_transaction(self) -> bool: ...

    @abstractmethod
    def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None: ...

    @abstractmethod
    def begin_locked(self, lock: LockStatement) -> None: ...

    @abstractmethod
    def lock_in_savepoint(self, lock: LockStatement) -> None: ...

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def rollback(self) -> None: ...

    @abstractmethod
    def discard(self) -> None: ...

    @abstractmethod
    def checkin(self) -> None: ...

    @abstractmethod
    def sever(self) -> None:
        """Shut the connection's socket down; callable from another thread, where a
        watchdog uses it to end a rollback that does not return."""
