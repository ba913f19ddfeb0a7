"""The ``with`` half of ``pgcoord.semaphore()``: the same steps as the ``async
with`` half in ``pgcoord.semaphores``, on psycopg and SQLAlchemy sync sources. A
sync wait listens the same way and watches the connection's socket with
a selector; cleanups are bounded by the watchdog that bounds ``exclusive()``'s.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import _errmap, metrics
from . import semaphores as _sem
from ._aio import CLEANUP_TIMEOUT
from ._drivers import release_sync
from ._drivers.base import SyncTxSession
from ._drivers.release import _discard_sync, _watchdog
from ._queries import query
from ._semwait import SyncLaneConn, can_listen, driver_connection
from .locks import DEAD_POOLED_RETRIES

if TYPE_CHECKING:
    from ._drivers.base import AsyncTxSession
    from .semaphores import SemaphoreRequest


class SyncSemaphore:
    """``with`` for :class:`pgcoord.semaphores.Semaphore` (its base)."""

    request: SemaphoreRequest
    wait_seconds: float | None
    _session: AsyncTxSession | SyncTxSession | None
    _joined: bool

    # Defined by the async half (Semaphore), which this class is the base of.
    def _start(self, *, want_async: bool) -> Any:
        raise NotImplementedError

    def _deadline(self, started: float) -> float | None:
        raise NotImplementedError

    def _needs_record(self) -> bool:
        raise NotImplementedError

    def _record_params(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _found_dead(self, session: Any, exc: BaseException) -> bool:
        raise NotImplementedError

    def _pause(self, pause: float, deadline: float | None) -> float:
        raise NotImplementedError

    def __enter__(self) -> Any:
        retries = DEAD_POOLED_RETRIES
        started = time.monotonic()
        deadline = self._deadline(started)
        while True:
            session = self._start(want_async=False)
            assert isinstance(session, SyncTxSession)
            try:
                conn = session.checkout()
            except BaseException:
                self._session = None
                raise
            try:
                self._joined = session.in_transaction()
                if self._needs_record():
                    self._record_sync(session)
                if self._joined:
                    self._take_joined_sync(session, deadline)
                else:
                    self._take_sync(session, deadline)
            except BaseException as exc:
                self._session = None
                release_sync(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    _sem.log.info("pgcoord: a pooled connection was closed by the server (%r); "
                             "trying another", exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.name, self.wait_seconds)
        return conn

    def _record_sync(self, session: SyncTxSession) -> None:
        try:
            session.run_autocommit(query("semaphore_record"), self._record_params())
        except Exception as exc:
            if _errmap.session_gone(exc):
                raise
            _sem.log.debug("semaphore %r not recorded: %s", self.request.name, exc)
        _sem.recorded.add((self.request.name, self.request.limit))

    def _take_joined_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        pause = _sem._JOINED_FIRST_PAUSE
        while True:
            try:
                session.lock_in_savepoint(self.request.joined_take)
                return
            except Exception as exc:
                if not (self.request.must_wait
                        and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                    raise
            time.sleep(self._pause(pause, deadline))
            pause = min(pause * 2, _sem.SEMAPHORE_RECHECK)

    def _take_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        request = self.request
        try:
            session.begin_locked(request.take)
            return
        except Exception as exc:
            if not (request.must_wait and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                raise
        session.rollback()
        driver = driver_connection(session)
        if not can_listen(driver, want_async=False):
            self._retry_sync(session, deadline)  # a driver pgcoord cannot hear on
            return
        lanes = SyncLaneConn(driver, request.key)
        if lanes.behind_pooler():
            self._retry_sync(session, deadline)
            return
        lane: int | None = None
        try:
            lane = self._wait_sync(lanes, deadline)
            session.begin_locked(request.adopt(lane))
        except BaseException:
            self._abandon_sync(session, lanes, adopting=lane is not None)
            raise

    def _retry_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        pause = _sem._JOINED_FIRST_PAUSE
        while True:
            time.sleep(self._pause(pause, deadline))
            pause = min(pause * 2, _sem.SEMAPHORE_RECHECK)
            try:
                session.begin_locked(self.request.take)
                return
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_BUSY:
                    raise
            session.rollback()

    def _wait_sync(self, lanes: SyncLaneConn, deadline: float | None) -> int:
        request = self.request
        lanes.listen()
        enter = True
        while True:
            lane = lanes.fetchval(query("semaphore_wait_try"), request.key, request.limit,
                                  enter, None)
            enter = False
            if lane is not None:
                lanes.forget()
                return int(lane)
            pause = _sem.SEMAPHORE_RECHECK
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
                if pause <= 0:
                    raise request.timed_out()
            lanes.wait(pause)

    def _abandon_sync(
        self, session: SyncTxSession, lanes: SyncLaneConn, *, adopting: bool = False,
    ) -> None:
        """``_abandon_async`` for a sync connection: past CLEANUP_TIMEOUT the shared
        watchdog shuts its socket down, so the statement returns with an error and
        the connection is discarded."""
        guard = _watchdog.guard(CLEANUP_TIMEOUT, session.sever)
        try:
            if session.in_transaction():
                session.rollback()
            freed = lanes.fetchval(query("semaphore_wait_abandon"), self.request.key)
            lanes.forget()
            if adopting and not freed:  # the rollback freed the adopted lane
                lanes.fetchval(query("semaphore_wake"), self.request.key)
        except Exception as exc:
            _sem.log.warning("pgcoord: discarding the connection after a failed semaphore cleanup: %r",
                        exc)
            _discard_sync(session)
        finally:
            if guard.stop():
                _discard_sync(session)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        assert isinstance(session, SyncTxSession)
        if self._joined:
            return
        if exc_type is not None:
            self._end_rolled_back_sync(session)
            return
        if not session.in_transaction():
            self._end_sync(session, rollback=True)  # the body's COMMIT freed the lane
            raise self.request.ended_early()
        try:
            session.commit()
        except BaseException:
            self._end_sync(session, rollback=True)
            raise
        self._end_sync(session, rollback=False)

    def _end_rolled_back_sync(self, session: SyncTxSession) -> None:
        self._end_sync(session, rollback=True)

    def _end_sync(self, session: SyncTxSession, *, rollback: bool) -> None:
        """``_end_async`` for a sync connection, watched as ``_abandon_sync``."""
        done = False
        guard = _watchdog.guard(CLEANUP_TIMEOUT, session.sever)
        try:
            if rollback:
                session.rollback()
            driver = driver_connection(session)
            if can_listen(driver, want_async=False):  # one round trip
                SyncLaneConn(driver, self.request.key).fetchval(
                    query("semaphore_wake"), self.request.key)
            else:
                session.run_autocommit(query("semaphore_wake"), (self.request.key,))
            done = True
        except Exception as exc:
            _sem.log.warning("pgcoord: waking semaphore waiters after a release failed: %r", exc)
        finally:
            if guard.stop():
                done = False
            release_sync(session, rollback=not done)
