"""``exclusive()``: a transaction-scoped advisory lock, atomic with the caller's writes.

The lock is ``pg_advisory_xact_lock`` (or its shared or ``try`` form), so the
server releases it at commit or rollback and a crashed process can never leave
it behind. Timeouts are the server's ``lock_timeout``, never client polling.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from types import TracebackType
from typing import Any, NoReturn

from . import _errmap, metrics
from ._drivers import check_source, release_async, release_sync, tx_session
from ._drivers.base import AsyncTxSession, LockStatement, SyncTxSession
from ._keys import LockKeyLike, key_and_name
from ._queries import query
from .errors import Deadlock, LockBusy, LockTableFull, LockTimeout, PgcoordError

__all__ = ["ExclusiveLock", "LockRequest", "exclusive"]

log = logging.getLogger("pgcoord.locks")

# A pooled connection that the server ended while it sat idle in its pool
# (pg_terminate_backend, a restart, idle_session_timeout) is found out only at its
# first statement. Nothing is locked and no user code has run then, so the lock is
# asked for again on another connection, this many more times at most.
DEAD_POOLED_RETRIES = 2

# Names recorded in pgcoord.lock_names by this process. Recording is best effort
# and happens once per name, so later uses cost no extra round trip.
_recorded_names: set[int] = set()


class LockRequest:
    """What to lock and how: validated once, rendered to one SQL statement."""

    __slots__ = ("key", "name", "shared", "statement", "timeout", "wait")

    def __init__(
        self, key: LockKeyLike, *, wait: bool, timeout: float | None, shared: bool,
        scope: str = "xact",
    ) -> None:
        self.key, self.name = key_and_name(key)
        if not isinstance(wait, bool):
            raise TypeError("wait must be a bool")
        if not isinstance(shared, bool):
            raise TypeError("shared must be a bool")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
            if not math.isfinite(timeout) or timeout < 0:
                raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
            if not wait:
                raise ValueError("timeout has no meaning with wait=False")
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
            within = f" within {self.timeout}s" if self.timeout is not None else ""
            return LockTimeout(f"advisory lock {self.describe()} not granted{within} (lock_timeout)")
        if code == _errmap.SQLSTATE_DEADLOCK:
            return Deadlock(
                f"deadlock detected while waiting for advisory lock {self.describe()}"
            )
        if code == _errmap.SQLSTATE_OUT_OF_SHARED_MEMORY:
            return LockTableFull()
        return None

    def ended_early(self) -> PgcoordError:
        """The body committed or rolled back itself, and so released the lock mid-block."""
        return PgcoordError(
            f"the transaction holding advisory lock {self.describe()} was ended inside the block "
            "(an explicit commit or rollback), which released the lock there; let the block "
            "commit, or use a savepoint"
        )

    def raise_translated(self, exc: BaseException) -> NoReturn:
        mapped = self.translate(exc)
        if mapped is None:
            raise exc
        raise mapped from exc


@functools.lru_cache(maxsize=4096)
def _statement(key: int, fn: str, wait: bool, timeout: float | None) -> LockStatement:
    """The lock statement for one key and mode; cached, as services reuse their keys."""
    if not wait or timeout == 0:
        inline = query("advisory_try").format(fn=fn.replace("pg_", "pg_try_", 1), key=key)
        return LockStatement(inline, inline, ())
    if timeout is None:
        return LockStatement(query("advisory_wait").format(fn=fn, key=key),
                             query("advisory_call").format(fn=fn), (key,))
    timeout_ms = max(1, math.ceil(timeout * 1000))
    inline = query("advisory_timeout").format(fn=fn, key=key, timeout_ms=timeout_ms)
    return LockStatement(inline, inline, ())


def exclusive(
    source: Any, key: LockKeyLike, *, wait: bool = True, timeout: float | None = None,
    shared: bool = False,
) -> ExclusiveLock:
    """A transaction-scoped advisory lock on ``key``; see DESIGN §1.

    ``async with`` for asyncpg, psycopg async and SQLAlchemy async sources,
    ``with`` for psycopg and SQLAlchemy sync sources. Yields the driver's own
    connection inside an open transaction that also holds the lock.
    """
    try:
        request = _request(key, wait, timeout, shared)
    except TypeError:  # unhashable: build it uncached, which raises the precise error
        request = LockRequest(key, wait=wait, timeout=timeout, shared=shared)
    return ExclusiveLock(source, request)


@functools.lru_cache(maxsize=4096, typed=True)
def _request(key: LockKeyLike, wait: bool, timeout: float | None, shared: bool) -> LockRequest:
    """Requests are immutable and services reuse their keys: validate each once.
    ``typed`` keeps ``True`` apart from ``1``, which would be refused."""
    return LockRequest(key, wait=wait, timeout=timeout, shared=shared)


class ExclusiveLock:
    """The context manager returned by :func:`exclusive`. Single use at a time."""

    def __init__(self, source: Any, request: LockRequest) -> None:
        check_source(source)
        self._source = source
        self.request = request
        self._session: AsyncTxSession | SyncTxSession | None = None
        self._joined = False
        #: Seconds spent waiting for the grant, set on entry (for metrics and logs).
        self.wait_seconds: float | None = None

    def _start(self, *, want_async: bool) -> Any:
        if self._session is not None:
            raise RuntimeError("this pgcoord.exclusive() is already entered; create one per use")
        session = tx_session(self._source, want_async=want_async)
        self._session = session
        return session

    def _needs_name_record(self) -> bool:
        return (
            self.request.name is not None and not self._joined
            and self.request.key not in _recorded_names
        )

    def _name_recorded(self) -> None:
        _recorded_names.add(self.request.key)

    def _found_dead(self, session: AsyncTxSession | SyncTxSession, exc: BaseException) -> bool:
        """Whether the connection just checked out of a pool was already dead."""
        return session.pooled and not self._joined and _errmap.session_gone(exc)

    def _retrying(self, exc: BaseException) -> None:
        log.info("pgcoord: the pooled connection for lock %s was closed by the server (%r); "
                 "trying another", self.request.describe(), exc)

    # -- async -----------------------------------------------------------------

    async def __aenter__(self) -> Any:
        retries = DEAD_POOLED_RETRIES
        while True:
            session = self._start(want_async=True)
            assert isinstance(session, AsyncTxSession)
            try:
                conn = await session.checkout()
            except BaseException:
                self._session = None  # nothing checked out: the lock may be entered again
                raise
            started = time.monotonic()
            try:
                self._joined = session.in_transaction()
                if self._needs_name_record():
                    await self._record_name_async(session)
                if self._joined:
                    await session.lock_in_savepoint(self.request.statement)
                else:
                    await session.begin_locked(self.request.statement)
            except BaseException as exc:
                self._session = None
                await release_async(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    self._retrying(exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.metric_name, self.wait_seconds)
        return conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every way out ends in release_async(): a rollback and a give-back bounded
        # by CLEANUP_TIMEOUT that leave the caller its own outcome.
        session, self._session = self._session, None
        assert isinstance(session, AsyncTxSession)
        if self._joined:
            return  # the lock belongs to the caller's transaction
        if exc_type is not None:
            await release_async(session, rollback=True)
            return
        if not session.in_transaction():
            await release_async(session, rollback=True)
            raise self.request.ended_early()
        try:
            # Not bounded: the COMMIT is the body's own outcome, and may wait
            # (deferred triggers) as long as any statement of the body.
            await session.commit()
        except BaseException:
            await release_async(session, rollback=True)
            raise
        await release_async(session, rollback=False)

    async def _record_name_async(self, session: AsyncTxSession) -> None:
        assert self.request.name is not None
        try:
            await session.run_autocommit(
                query("lock_names_record"), (self.request.key, self.request.name)
            )
        except Exception as exc:  # best effort: missing schema, no privilege, read-only
            if _errmap.session_gone(exc):
                raise  # a dead connection: the lock is asked for on another
            log.debug("lock name %r not recorded: %s", self.request.name, exc)
        self._name_recorded()

    # -- sync ------------------------------------------------------------------

    def __enter__(self) -> Any:
        retries = DEAD_POOLED_RETRIES
        while True:
            session = self._start(want_async=False)
            assert isinstance(session, SyncTxSession)
            try:
                conn = session.checkout()
            except BaseException:
                self._session = None
                raise
            started = time.monotonic()
            try:
                self._joined = session.in_transaction()
                if self._needs_name_record():
                    self._record_name_sync(session)
                if self._joined:
                    session.lock_in_savepoint(self.request.statement)
                else:
                    session.begin_locked(self.request.statement)
            except BaseException as exc:
                self._session = None
                release_sync(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    self._retrying(exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.metric_name, self.wait_seconds)
        return conn

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        assert isinstance(session, SyncTxSession)
        if self._joined:
            return
        if exc_type is not None:
            release_sync(session, rollback=True)
            return
        if not session.in_transaction():
            release_sync(session, rollback=True)
            raise self.request.ended_early()
        try:
            session.commit()
        except BaseException:
            release_sync(session, rollback=True)
            raise
        release_sync(session, rollback=False)

    def _record_name_sync(self, session: SyncTxSession) -> None:
        assert self.request.name is not None
        try:
            session.run_autocommit(
                query("lock_names_record"), (self.request.key, self.request.name)
            )
        except Exception as exc:
            if _errmap.session_gone(exc):
                raise
            log.debug("lock name %r not recorded: %s", self.request.name, exc)
        self._name_recorded()


