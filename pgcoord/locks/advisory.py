"""``exclusive()``: a transaction-scoped advisory lock, atomic with the caller's writes.

The lock is ``pg_advisory_xact_lock`` (or its shared or ``try`` form), so the
server releases it at commit or rollback and a crashed process can never leave
it behind. Timeouts are the server's ``lock_timeout``, never client polling.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, NoReturn

from .._core import errmap as _errmap
from .._core.queries import query
from .._core.recent import RecentSet
from .._drivers.base import LockStatement
from ..errors import Deadlock, LockBusy, LockTableFull, LockTimeout, PgcoordError
from ..keys import LockKeyLike, key_and_name
from ..observability import metrics
from .txscope import DEAD_POOLED_RETRIES as DEAD_POOLED_RETRIES
from .txscope._async.exclusive import AsyncExclusive
from .txscope._sync.exclusive import SyncExclusive
from .txscope.base import check_timeout, check_wait, ended_early, request_cache

__all__ = ["ExclusiveLock", "LockRequest", "exclusive"]

log = logging.getLogger("pgcoord.locks")

# Keys whose names this process recorded in pgcoord.lock_names (or tried to): by
# exclusive() and by session locks (LockHolder). Recording is best effort and
# happens once per key, so later uses cost no extra round trip; bounded, for an
# application that locks per entity (see _core/recent.py).
RECORDED_NAMES_KEPT = 10_000
recorded_names: RecentSet[int] = RecentSet(RECORDED_NAMES_KEPT)


class LockRequest:
    """What to lock and how: validated once, rendered to one SQL statement."""

    __slots__ = ("key", "name", "shared", "statement", "timeout", "wait")

    def __init__(
        self, key: LockKeyLike, *, wait: bool, timeout: float | None, shared: bool,
        scope: str = "xact",
    ) -> None:
        self.key, self.name = key_and_name(key)
        check_wait(wait)
        if not isinstance(shared, bool):
            raise TypeError("shared must be a bool")
        check_timeout(timeout, wait)
        self.wait, self.timeout, self.shared = wait, timeout, shared
        fn = "pg_advisory" + ("_xact" if scope == "xact" else "") + "_lock"
        if shared:
            fn += "_shared"
        self.statement = _statement(self.key, fn, wait, timeout)

    def describe(self) -> str:
        return repr(self.name) if self.name is not None else str(self.key)

    @property
    def metric_name(self) -> str:
        # Metrics are labelled by name only: numeric keys share one label so
        # that cardinality stays bounded.
        return self.name if self.name is not None else "(numeric key)"

    def translate(self, exc: BaseException) -> PgcoordError | None:
        """The pgcoord error for a driver error raised while taking this lock."""
        code = _errmap.sqlstate(exc)
        if code == _errmap.SQLSTATE_LOCK_BUSY:
            metrics.busy(self.metric_name)
            if self.timeout == 0:
                return LockTimeout(f"advisory lock {self.describe()} not granted within 0s")
            return LockBusy(f"advisory lock {self.describe()} is held by another session")
        if code == _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
            return LockTimeout(f"advisory lock {self.describe()} {not_granted(self.timeout)}")
        if code == _errmap.SQLSTATE_DEADLOCK:
            return Deadlock(
                f"deadlock detected while waiting for advisory lock {self.describe()}"
            )
        if code == _errmap.SQLSTATE_OUT_OF_SHARED_MEMORY:
            return LockTableFull()
        return None

    def ended_early(self) -> PgcoordError:
        return ended_early(f"advisory lock {self.describe()}", "the lock")

    def raise_translated(self, exc: BaseException) -> NoReturn:
        mapped = self.translate(exc)
        if mapped is None:
            raise exc
        raise mapped from exc


def not_granted(timeout: float | None) -> str:
    """How a 55P03 reads: pgcoord's own bound, or a lock_timeout pgcoord did not set
    (a statement on a shared session that must not wait, say)."""
    if timeout is None:
        return ("not granted: the session's lock_timeout cut a wait without a timeout "
                "short (pgcoord sets none on it: a setting of the session's own did)")
    return f"not granted within {timeout}s (lock_timeout)"


@functools.lru_cache(maxsize=4096)
def _statement(key: int, fn: str, wait: bool, timeout: float | None) -> LockStatement:
    """The lock statement for one key and mode; cached, as services reuse their keys."""
    if not wait or timeout == 0:
        inline = query("advisory_try").format(fn=fn.replace("pg_", "pg_try_", 1), key=key)
        return LockStatement(inline, inline, ())
    # A wait is bounded by pgcoord alone: lock_timeout is set for the lock's own
    # statement (0, "until granted", for timeout=None) and put back after it.
    # ``inline`` also keeps statement_timeout off it (advisory_untimed_*, three
    # statements in one simple-protocol message, or ``steps`` queued in one psycopg
    # pipeline sync); ``bound`` is one statement, for the paths that send one (a DO
    # block: lock_timeout only).
    timeout_ms = 0 if timeout is None else max(1, math.ceil(timeout * 1000))
    single = query("advisory_timeout").format(fn=fn, key=key, timeout_ms=timeout_ms)
    steps = tuple(query(f"advisory_untimed_{step}").format(fn=fn, key=key, timeout_ms=timeout_ms)
                  for step in ("arm", "lock", "disarm"))
    return LockStatement(";\n".join(steps), single, (), steps)


def exclusive(
    source: Any, key: LockKeyLike, *, wait: bool = True, timeout: float | None = None,
    shared: bool = False,
) -> ExclusiveLock:
    """A transaction-scoped advisory lock on ``key``; see docs/exclusive.md.

    ``async with`` for asyncpg, psycopg async and SQLAlchemy async sources,
    ``with`` for psycopg and SQLAlchemy sync sources. Yields the driver's own
    connection inside an open transaction that also holds the lock.
    """
    return ExclusiveLock(source, _request(key, wait, timeout, shared))


@request_cache
def _request(key: LockKeyLike, wait: bool, timeout: float | None, shared: bool) -> LockRequest:
    return LockRequest(key, wait=wait, timeout=timeout, shared=shared)


class ExclusiveLock(AsyncExclusive, SyncExclusive):
    """What :func:`exclusive` returns (see ``pgcoord._txscope.base.TxScoped``)."""

    CALL = "pgcoord.exclusive()"
    RECORDS = "lock name"
    _log = log
    request: LockRequest

    def _what(self) -> str:
        return f"lock {self.request.describe()}"

    def _needs_record(self) -> bool:
        return (
            self.request.name is not None and not self._joined
            and self.request.key not in recorded_names
        )

    def _record_statement(self) -> tuple[str, tuple[Any, ...]]:
        return query("lock_names_record"), (self.request.key, self.request.name)

    def _recorded(self) -> None:
        recorded_names.add(self.request.key)
