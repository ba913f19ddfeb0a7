"""``semaphore()``: at most ``limit`` holders of a name across every process,
transaction-scoped; see docs/semaphores.md.

A semaphore is ``limit`` *lanes*, the two-int advisory locks ``(k, 0) ..
(k, limit-1)`` with ``k = semaphore_key(name)`` (sql/0005_semaphores.up.sql). A
holder's transaction holds one lane (``pg_try_advisory_xact_lock``), so the server
admits at most ``limit`` and frees a crashed holder's lane with its session.

A session can queue in the server for one lock only, and a waiter wants *any*
lane, so waiting is not a server lock wait: the waiter LISTENs on
``pgcoord_semaphores`` and tries again on each notification for its key. Every
release sends one when someone is in the waiting room: pgcoord sends it after
the commit or rollback that freed the lane (a NOTIFY inside the transaction
would make its commit take a database-wide lock); in the caller's own
transaction, whose end pgcoord does not see, the acquire queues it for commit.
A crashed holder sends nothing, and a notification could overtake the release
it announces; for those a waiter also tries every ``SEMAPHORE_RECHECK`` seconds.
That is the crash path: a normal release reaches a waiter by notification (bench/semaphore.py measures it).

The wait runs on the caller's own connection, before its transaction: it
LISTENs, enters the *waiting room* (the shared session lock ``(k, -1)``, which
``pgcoord.holders`` shows as a waiter), takes a lane at session level when one is
free, stops listening, and only then BEGINs and turns that lane into the
transaction's. The connection goes back with no LISTEN, no lock and no
transaction on every path. The ``async with`` half is in ``pgcoord.locks.txscope``, and
the ``with`` half (sync sources) is generated from it.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from .._core import errmap as _errmap
from .._core.queries import query
from .._core.recent import RecentSet
from .._drivers.base import LockStatement
from ..errors import LockBusy, LockTableFull, LockTimeout, PgcoordError, SchemaMissing
from ..keys import semaphore_key
from ..observability import metrics
from .txscope._async.semaphore import AsyncSemaphore
from .txscope._sync.semaphore import SyncSemaphore
from .txscope.base import check_timeout, check_wait, ended_early, request_cache

__all__ = ["SEMAPHORE_RECHECK", "Semaphore", "SemaphoreRequest", "semaphore"]

log = logging.getLogger("pgcoord.semaphores")

#: A waiter tries again this often even without a notification: the crash path
#: (a holder whose session died sent none), never the normal one.
SEMAPHORE_RECHECK = 0.5

#: The most lanes one semaphore may have (a failed try walks them all).
MAX_LIMIT = 10_000

# (name, limit) pairs recorded in pgcoord.semaphores by this process (bounded as
# advisory.recorded_names is).
recorded: RecentSet[tuple[str, int]] = RecentSet(1_000)


class SemaphoreRequest:
    """What to acquire and how: validated once, at the call."""

    __slots__ = ("joined_take", "key", "limit", "name", "take", "timeout", "wait")

    def __init__(self, name: str, *, limit: int, wait: bool, timeout: float | None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"semaphore name must be a str, not {type(name).__name__}")
        if not name:
            raise ValueError("semaphore name must not be empty")
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int, not {type(limit).__name__}")
        if not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be between 1 and {MAX_LIMIT}, got {limit}")
        check_wait(wait)
        check_timeout(timeout, wait)
        self.name, self.limit, self.wait, self.timeout = name, limit, wait, timeout
        self.key = semaphore_key(name)
        self.take = LockStatement(query("semaphore_take").format(key=self.key, limit=limit),
                                  query("semaphore_take_call"), (self.key, limit))
        joined = query("semaphore_take_joined").format(key=self.key, limit=limit)
        self.joined_take = LockStatement(joined, joined, ())

    @property
    def must_wait(self) -> bool:
        """Whether a busy first try is waited out (rather than LockBusy/LockTimeout)."""
        return self.wait and self.timeout != 0

    def adopt(self, lane: int) -> LockStatement:
        sql = query("semaphore_adopt").format(key=self.key, lane=int(lane))
        return LockStatement(sql, sql, ())

    def describe(self) -> str:
        return f"semaphore {self.name!r} (limit {self.limit})"

    @property
    def metric_name(self) -> str:
        return self.name

    def busy(self) -> PgcoordError:
        metrics.busy(self.name)
        if self.timeout == 0:
            return LockTimeout(f"{self.describe()}: no free slot within 0s")
        return LockBusy(f"{self.describe()}: every slot is taken")

    def own_slots(self, who: str) -> PgcoordError:
        """A nested wait whose every slot is held by the waiter itself: it would
        wait for itself forever, so it is refused at once."""
        return PgcoordError(
            f"{self.describe()}: {who} already holds every slot it counts, so waiting "
            "would never end; release one first (or use a larger limit)")

    def timed_out(self) -> LockTimeout:
        return LockTimeout(f"{self.describe()}: no free slot within {self.timeout}s")

    def translate(self, exc: BaseException) -> BaseException:
        """The pgcoord error for a driver error raised while acquiring, else ``exc``."""
        code = _errmap.sqlstate(exc)
        if code == _errmap.SQLSTATE_LOCK_BUSY:
            return self.busy()
        if code == _errmap.SQLSTATE_OWN_SLOTS:
            return self.busy() if not self.must_wait else self.own_slots("this transaction")
        if code == _errmap.SQLSTATE_OUT_OF_SHARED_MEMORY:
            return LockTableFull()
        mapped = _errmap.as_schema_missing(exc)
        if isinstance(mapped, SchemaMissing):
            return SchemaMissing(
                "pgcoord semaphores need pgcoord's schema at revision 0005 or later; "
                "run `pgcoord migrate` (or `alembic upgrade head` with pgcoord's migrations)")
        return exc

    def raise_translated(self, exc: BaseException) -> NoReturn:
        mapped = self.translate(exc)
        if mapped is exc:
            raise exc
        raise mapped from exc

    def ended_early(self) -> PgcoordError:
        return ended_early(f"a slot of {self.describe()}", "the slot")


def semaphore(
    source: Any, name: str, *, limit: int, wait: bool = True, timeout: float | None = None,
) -> Semaphore:
    """One of ``limit`` slots of semaphore ``name``, held by a transaction; see docs/semaphores.md.

    ``async with`` for asyncpg, psycopg async and SQLAlchemy async sources, ``with``
    for psycopg and SQLAlchemy sync sources, as ``exclusive()``. Yields the driver's
    own connection inside an open transaction that holds the slot until it ends.
    ``wait=False`` raises ``LockBusy`` when every slot is taken; ``timeout`` bounds
    the whole wait (``LockTimeout``).
    """
    return Semaphore(source, _request(name, limit, wait, timeout))


@request_cache
def _request(name: str, limit: int, wait: bool, timeout: float | None) -> SemaphoreRequest:
    return SemaphoreRequest(name, limit=limit, wait=wait, timeout=timeout)


class Semaphore(AsyncSemaphore, SyncSemaphore):
    """What :func:`semaphore` returns (see ``pgcoord._txscope.base.TxScoped``)."""

    CALL = "pgcoord.semaphore()"
    RECORDS = "semaphore"
    WAIT_FROM_CALL = True
    _log = log
    request: SemaphoreRequest

    def _recheck(self) -> float:
        return SEMAPHORE_RECHECK  # read at each use: tests raise it

    def _needs_record(self) -> bool:
        return not self._joined and (self.request.name, self.request.limit) not in recorded

    def _record_statement(self) -> tuple[str, tuple[Any, ...]]:
        return query("semaphore_record"), (self.request.name, self.request.key, self.request.limit)

    def _recorded(self) -> None:
        recorded.add((self.request.name, self.request.limit))
