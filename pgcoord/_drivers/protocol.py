"""The two kinds of session pgcoord runs statements on, as protocols.

- ``TxSession`` (and ``SyncTxSession``, generated from it): one transaction on one
  connection of a pool, an engine or the caller's own; what ``exclusive()``,
  ``semaphore()``, ``check_fence``'s callers and a lease's statements need. Defined
  in ``_async/session.py`` so that its sync half is generated.
- ``DedicatedSession``: one driver connection used outside any transaction for as
  long as its owner lives (session locks, a lease's doorbell, a member's
  session), which can LISTEN and tells its owner when the server closes it. What
  ``LockHolder``, ``Elector``, ``Member`` and ``doctor`` hold.

The driver modules implement them (and name them as bases, so that mypy checks
each class against its protocol); ``adapt()`` finds the implementation for an
object. Nothing outside ``_drivers`` names a driver's class.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from ._async.session import AsyncTxSession
from ._sync.session import SyncTxSession

#: The transaction session of async code (the name the features use).
TxSession = AsyncTxSession

__all__ = ["LEND_TIMEOUT", "AsyncTxSession", "DedicatedSession", "Lender", "SessionSource",
           "SyncTxSession", "TxSession", "Unlisten"]

#: How long ``SessionSource.open_now()`` lets a pool take to lend a connection it
#: said it had (the pool may have to open it). Past it, the answer is None.
LEND_TIMEOUT = 10.0


class Unlisten(Protocol):
    """Stop hearing a channel that ``DedicatedSession.listen`` subscribed to.

    The callback is forgotten; the server's UNLISTEN is the caller's business
    (pgcoord sends it with the statement that ends the wait), except that asyncpg
    sends one itself when the last callback of a channel goes. ``lost=True``: the
    session is known to be gone, so nothing is sent over it."""

    async def __call__(self, *, lost: bool = False) -> None: ...


class Lender(Protocol):
    """How a borrowed connection goes back to its pool: as good, or as broken."""

    @abstractmethod
    async def give_back(self, driver_conn: Any) -> None: ...

    @abstractmethod
    async def discard(self, driver_conn: Any) -> None:
        """The connection is closed at our end already; free its slot."""


class DedicatedSession(Protocol):
    """One driver connection used outside any transaction, opened from a DSN or
    borrowed from a pool (then given back through its ``Lender``)."""

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

    async def prepare(self) -> None:
        """Make a fresh or borrowed connection fit for session locks."""
        return None  # a hook: nothing to do unless a driver's session says otherwise

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` as soon as the driver sees the connection close."""
        return None  # a hook: the asyncpg and psycopg sessions implement it

    async def listen(self, channel: str, callback: Callable[[str], None]) -> Unlisten:
        """LISTEN on ``channel`` and call ``callback(payload)`` for each
        notification, as soon as it arrives, also while no statement runs.

        The asyncpg and psycopg sessions implement it. A session that is a view
        of another one (a member's, which features share) does not: listening
        there goes through its owner (``Member.listen``)."""
        raise TypeError(f"{type(self).__qualname__} cannot LISTEN by itself")

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
        is gone so it frees the slot. Waits on the network only for a cancel
        request already on its way (a stopped statement must not go on on the
        server), and then briefly."""

    @abstractmethod
    async def give_back(self) -> None:
        """Return a borrowed connection to its pool, or close an owned one."""


class SessionSource(Protocol):
    """Where dedicated sessions come from: opened from a DSN, or borrowed from a
    pool or engine (given back only after their owner proved them clean, and
    *broken*, so that the pool replaces them, when they were discarded)."""

    @abstractmethod
    async def open(self) -> DedicatedSession:
        """A session, waiting for it as any borrower of the pool would (the pool's
        own timeout becomes ``PoolExhausted``)."""

    @abstractmethod
    async def open_now(self) -> DedicatedSession | None:
        """A session if one can be had without waiting for another borrower to
        give one back; None otherwise. pgcoord takes every session beyond the
        first this way, so that it never waits on a pool for a connection it
        itself holds (with ``max_size=1`` that wait could never end)."""
