"""What ``exclusive()`` needs from a driver: one transaction on one connection.

Each driver module implements the session (``AsyncTxSession`` in ``_async/session.py``,
and ``SyncTxSession`` generated from it) for its pool and connection types. A
session checks a connection out (or uses the one it was given), takes the lock
either by opening a transaction or by joining the caller's one inside a
savepoint, and ends or discards it. Driver errors pass through unchanged; the
caller maps them by SQLSTATE.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .._core.queries import query
from ._async.session import AsyncTxSession as AsyncTxSession
from ._sync.session import SyncTxSession as SyncTxSession


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
    #: ``inline`` as single statements, for a psycopg pipeline, which takes one
    #: statement at a time but sends them in one round trip; empty where
    #: ``bound`` with ``params`` says it all.
    steps: tuple[str, ...] = ()

    def pipelined(self) -> tuple[tuple[str, tuple[int, ...] | None], ...]:
        """The statements (and parameters) to queue in a pipeline, in order."""
        if self.steps:
            return tuple((step, None) for step in self.steps)
        return ((self.bound, self.params or None),)


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
    return query("begin_and_lock").format(
        mode=transaction_mode(isolation, read_only, deferrable), lock=lock.inline)


@functools.lru_cache(maxsize=64)
def begin_statement(
    isolation: str | None = None, read_only: bool | None = None, deferrable: bool | None = None,
) -> str:
    """BEGIN alone, with the same characteristics as :func:`begin_and_lock`'s."""
    return "BEGIN" + transaction_mode(isolation, read_only, deferrable)


def transaction_mode(isolation: str | None, read_only: bool | None, deferrable: bool | None) -> str:
    mode = ""
    if isolation is not None:
        if isolation not in ISOLATION_LEVELS:
            raise ValueError(f"unknown isolation level {isolation!r}")
        mode += f" ISOLATION LEVEL {isolation}"
    if read_only is not None:
        mode += " READ ONLY" if read_only else " READ WRITE"
    if deferrable is not None:
        mode += " DEFERRABLE" if deferrable else " NOT DEFERRABLE"
    return mode
