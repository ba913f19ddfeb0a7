"""``semaphore()``: at most ``limit`` holders of a name across every process,
transaction-scoped; see DESIGN §8.

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
transaction on every path. The ``with`` half (sync sources) is in
``_semaphoresync``, this class's base.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from types import TracebackType
from typing import Any, NoReturn

from . import _errmap, metrics
from ._aio import CLEANUP_TIMEOUT, CleanupTimeout, finish_despite_cancel
from ._drivers import check_source, release_async, tx_session
from ._drivers.base import AsyncTxSession, LockStatement, SyncTxSession
from ._keys import semaphore_key
from ._queries import query
from ._semaphoresync import SyncSemaphore
from ._semwait import AsyncLaneConn, can_listen, driver_connection
from .errors import LockBusy, LockTableFull, LockTimeout, PgcoordError, SchemaMissing
from .locks import DEAD_POOLED_RETRIES

__all__ = ["SEMAPHORE_RECHECK", "Semaphore", "SemaphoreRequest", "semaphore"]

log = logging.getLogger("pgcoord.semaphores")

#: A waiter tries again this often even without a notification: the crash path
#: (a holder whose session died sent none), never the normal one.
SEMAPHORE_RECHECK = 0.5

#: The most lanes one semaphore may have (a failed try walks them all).
MAX_LIMIT = 10_000

# A waiter in the caller's own transaction cannot LISTEN (that would take effect
# at the caller's commit), and one behind a pooler (the server announced at
# connect is not the one that answers) cannot rely on any session-level state
# (LISTEN, the waiting room, a lane) staying on its server session: both try
# again after these pauses, doubling up to SEMAPHORE_RECHECK.
_JOINED_FIRST_PAUSE = 0.005

# (name, limit) pairs recorded in pgcoord.semaphores by this process.
recorded: set[tuple[str, int]] = set()


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
        if not isinstance(wait, bool):
            raise TypeError("wait must be a bool")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
            if not math.isfinite(timeout) or timeout < 0:
                raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
            if not wait:
                raise ValueError("timeout has no meaning with wait=False")
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
        return PgcoordError(
            f"the transaction holding a slot of {self.describe()} was ended inside the block "
            "(an explicit commit or rollback), which released the slot there; let the block "
            "commit, or use a savepoint")


def semaphore(
    source: Any, name: str, *, limit: int, wait: bool = True, timeout: float | None = None,
) -> Semaphore:
    """One of ``limit`` slots of semaphore ``name``, held by a transaction; see DESIGN §8.

    ``async with`` for asyncpg, psycopg async and SQLAlchemy async sources, ``with``
    for psycopg and SQLAlchemy sync sources, as ``exclusive()``. Yields the driver's
    own connection inside an open transaction that holds the slot until it ends.
    ``wait=False`` raises ``LockBusy`` when every slot is taken; ``timeout`` bounds
    the whole wait (``LockTimeout``).
    """
    try:
        request = _request(name, limit, wait, timeout)
    except TypeError:  # unhashable: build it uncached, which raises the precise error
        request = SemaphoreRequest(name, limit=limit, wait=wait, timeout=timeout)
    return Semaphore(source, request)


@functools.lru_cache(maxsize=4096, typed=True)
def _request(name: str, limit: int, wait: bool, timeout: float | None) -> SemaphoreRequest:
    return SemaphoreRequest(name, limit=limit, wait=wait, timeout=timeout)


class Semaphore(SyncSemaphore):
    """The context manager returned by :func:`semaphore`. Single use at a time."""

    def __init__(self, source: Any, request: SemaphoreRequest) -> None:
        check_source(source)
        self._source = source
        self.request = request
        self._session: AsyncTxSession | SyncTxSession | None = None
        self._joined = False
        #: Seconds spent waiting for the slot, set on entry.
        self.wait_seconds: float | None = None

    def _start(self, *, want_async: bool) -> Any:
        if self._session is not None:
            raise RuntimeError("this pgcoord.semaphore() is already entered; create one per use")
        session = tx_session(self._source, want_async=want_async)
        self._session = session
        return session

    def _deadline(self, started: float) -> float | None:
        timeout = self.request.timeout
        return None if timeout is None else started + timeout

    def _needs_record(self) -> bool:
        return not self._joined and (self.request.name, self.request.limit) not in recorded

    def _record_params(self) -> tuple[Any, ...]:
        return (self.request.name, self.request.key, self.request.limit)

    def _found_dead(self, session: AsyncTxSession | SyncTxSession, exc: BaseException) -> bool:
        return session.pooled and not self._joined and _errmap.session_gone(exc)

    def _pause(self, pause: float, deadline: float | None) -> float:
        """The next pause of a joined waiter, or LockTimeout past the deadline."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.request.timed_out()
            return min(pause, left)
        return pause

    # -- async -----------------------------------------------------------------

    async def __aenter__(self) -> Any:
        retries = DEAD_POOLED_RETRIES
        started = time.monotonic()
        deadline = self._deadline(started)
        while True:
            session = self._start(want_async=True)
            assert isinstance(session, AsyncTxSession)
            try:
                conn = await session.checkout()
            except BaseException:
                self._session = None
                raise
            try:
                self._joined = session.in_transaction()
                if self._needs_record():
                    await self._record_async(session)
                if self._joined:
                    await self._take_joined_async(session, deadline)
                else:
                    await self._take_async(session, deadline)
            except BaseException as exc:
                self._session = None
                await release_async(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    log.info("pgcoord: a pooled connection was closed by the server (%r); "
                             "trying another", exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.name, self.wait_seconds)
        return conn

    async def _record_async(self, session: AsyncTxSession) -> None:
        try:
            await session.run_autocommit(query("semaphore_record"), self._record_params())
        except Exception as exc:  # best effort: missing schema, no privilege, read-only
            if _errmap.session_gone(exc):
                raise
            log.debug("semaphore %r not recorded: %s", self.request.name, exc)
        recorded.add((self.request.name, self.request.limit))

    async def _take_joined_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        pause = _JOINED_FIRST_PAUSE
        while True:
            try:
                await session.lock_in_savepoint(self.request.joined_take)
                return
            except Exception as exc:
                if not (self.request.must_wait
                        and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                    raise
            await asyncio.sleep(self._pause(pause, deadline))
            pause = min(pause * 2, SEMAPHORE_RECHECK)

    async def _take_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        request = self.request
        try:
            await session.begin_locked(request.take)
            return
        except Exception as exc:
            if not (request.must_wait and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                raise
        await session.rollback()
        driver = driver_connection(session)
        if not can_listen(driver, want_async=True):
            await self._retry_async(session, deadline)  # a driver pgcoord cannot hear on
            return
        lanes = AsyncLaneConn(driver, request.key)
        if await lanes.behind_pooler():
            await self._retry_async(session, deadline)
            return
        lane: int | None = None
        try:
            lane = await self._wait_async(lanes, deadline)
            await session.begin_locked(request.adopt(lane))
        except BaseException:
            await self._abandon_async(session, lanes, adopting=lane is not None)
            raise

    async def _retry_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        """Behind a pooler: whole transactions tried again after growing pauses,
        with nothing held at session level between them."""
        pause = _JOINED_FIRST_PAUSE
        while True:
            await asyncio.sleep(self._pause(pause, deadline))
            pause = min(pause * 2, SEMAPHORE_RECHECK)
            try:
                await session.begin_locked(self.request.take)
                return
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_BUSY:
                    raise
            await session.rollback()

    async def _wait_async(self, lanes: AsyncLaneConn, deadline: float | None) -> int:
        """Listen, enter the waiting room, and try on every notification (and every
        SEMAPHORE_RECHECK) until a lane is got at session level; its number."""
        request = self.request
        await lanes.listen()
        enter = True
        while True:
            lane = await lanes.fetchval(query("semaphore_wait_try"), request.key, request.limit,
                                        enter, None)
            enter = False
            if lane is not None:
                await lanes.forget()  # the server stopped listening in the same statement
                return int(lane)
            pause = SEMAPHORE_RECHECK
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
                if pause <= 0:
                    raise request.timed_out()
            await lanes.wait(pause)

    async def _abandon_async(
        self, session: AsyncTxSession, lanes: AsyncLaneConn, *, adopting: bool = False,
    ) -> None:
        """Undo a wait: no transaction, no lane, no waiting room, no LISTEN; bounded.
        A connection that cannot be made so is discarded."""
        try:
            await finish_despite_cancel(self._undo_wait_async(session, lanes, adopting),
                                        bound=CLEANUP_TIMEOUT, on_timeout=session.sever)
        except CleanupTimeout as exc:
            log.warning("pgcoord: %s; the connection was closed", exc)
        except Exception as exc:
            log.warning("pgcoord: discarding the connection after a failed semaphore cleanup: %r",
                        exc)
            try:
                await session.discard()
            except Exception as close_exc:
                log.warning("pgcoord: closing the connection failed too: %r", close_exc)

    async def _undo_wait_async(
        self, session: AsyncTxSession, lanes: AsyncLaneConn, adopting: bool,
    ) -> None:
        # Always: a BEGIN cancelled in flight may not show as a transaction yet.
        await session.rollback()
        freed = await lanes.fetchval(query("semaphore_wait_abandon"), self.request.key)
        await lanes.forget()
        if adopting and not freed:
            # The adopt ran (the lane was the transaction's, freed by the rollback,
            # which the abandon could not see): tell the next waiter.
            await lanes.fetchval(query("semaphore_wake"), self.request.key)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        assert isinstance(session, AsyncTxSession)
        if self._joined:
            return  # the slot belongs to the caller's transaction
        if exc_type is not None:
            await self._end_rolled_back_async(session)
            return
        if not session.in_transaction():
            await self._end_async(session, rollback=True)  # the body's COMMIT freed the lane
            raise self.request.ended_early()
        try:
            await session.commit()
        except BaseException:
            await self._end_async(session, rollback=True)
            raise
        await self._end_async(session, rollback=False)

    async def _end_rolled_back_async(self, session: AsyncTxSession) -> None:
        await self._end_async(session, rollback=True)

    async def _end_async(self, session: AsyncTxSession, *, rollback: bool) -> None:
        """After the COMMIT (or a rollback, here) that freed the lane: wake a waiter
        if any is in the waiting room, then give back; bounded, as release_async.
        (No NOTIFY rides on the transaction itself: a commit that sends one takes
        a database-wide lock, see sql/0005_semaphores.up.sql.)"""
        done = False
        try:
            await finish_despite_cancel(self._wake_async(session, rollback),
                                        bound=CLEANUP_TIMEOUT, on_timeout=session.sever)
            done = True
        except CleanupTimeout as exc:
            log.warning("pgcoord: %s; the connection was closed", exc)
        except Exception as exc:
            log.warning("pgcoord: waking semaphore waiters after a release failed: %r", exc)
        finally:
            await release_async(session, rollback=not done)

    async def _wake_async(self, session: AsyncTxSession, rollback: bool) -> None:
        if rollback:
            await session.rollback()
        driver = driver_connection(session)
        if can_listen(driver, want_async=True):  # one round trip, outside any transaction
            await AsyncLaneConn(driver, self.request.key).fetchval(
                query("semaphore_wake"), self.request.key)
        else:
            await session.run_autocommit(query("semaphore_wake"), (self.request.key,))
