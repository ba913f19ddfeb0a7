# Generated from pgcoord/locks/txscope/_async/semaphore.py by tools/generate_sync.py: do not edit.
"""A half of ``semaphore()``: ``async with`` in ``_async/`` (written by hand), ``with``
in ``_sync/`` (generated). How a slot is taken, waited for and given back is told in
``pgcoord.semaphores``; a sync wait listens the same way, watching the connection's
socket with a selector, and its cleanups are bounded by the watchdog thread."""

from __future__ import annotations

import logging
import time
from abc import abstractmethod
from time import sleep
from typing import TYPE_CHECKING

from ...._core import errmap as _errmap
from ...._core.aio import CleanupTimeout
from ...._core.queries import query
from ...._drivers import bounded_sync, release_sync
from ...._drivers.base import SyncTxSession
from ...semwait import SyncLaneConn
from .scoped import SyncTxScoped

if TYPE_CHECKING:
    from ...semaphores import SemaphoreRequest

log = logging.getLogger("pgcoord.semaphores")

# A waiter in the caller's own transaction cannot LISTEN (that would take effect
# at the caller's commit), and one behind a pooler (the server announced at
# connect is not the one that answers) cannot rely on any session-level state
# (LISTEN, the waiting room, a lane) staying on its server session: both try
# again after these pauses, doubling up to SEMAPHORE_RECHECK.
JOINED_FIRST_PAUSE = 0.005


class SyncSemaphore(SyncTxScoped):
    request: SemaphoreRequest

    @abstractmethod
    def _recheck(self) -> float:
        """``pgcoord.semaphores.SEMAPHORE_RECHECK``, read at each use."""

    def _deadline(self, started: float) -> float | None:
        timeout = self.request.timeout
        return None if timeout is None else started + timeout

    def _pause(self, pause: float, deadline: float | None) -> float:
        """The next pause of a joined waiter, or LockTimeout past the deadline."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.request.timed_out()
            return min(pause, left)
        return pause

    def _take_joined_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        pause = JOINED_FIRST_PAUSE
        while True:
            try:
                session.lock_in_savepoint(self.request.joined_take)
                return
            except Exception as exc:
                if not (self.request.must_wait
                        and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                    raise
            sleep(self._pause(pause, deadline))
            pause = min(pause * 2, self._recheck())

    def _take_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        request = self.request
        try:
            session.begin_locked(request.take)
            return
        except Exception as exc:
            if not (request.must_wait and _errmap.sqlstate(exc) == _errmap.SQLSTATE_LOCK_BUSY):
                raise
        session.rollback()
        driver = session.driver_connection()
        if not SyncLaneConn.can_wait_on(driver):
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
        """Behind a pooler: whole transactions tried again after growing pauses,
        with nothing held at session level between them."""
        pause = JOINED_FIRST_PAUSE
        while True:
            sleep(self._pause(pause, deadline))
            pause = min(pause * 2, self._recheck())
            try:
                session.begin_locked(self.request.take)
                return
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_BUSY:
                    raise
            session.rollback()

    def _wait_sync(self, lanes: SyncLaneConn, deadline: float | None) -> int:
        """Listen, enter the waiting room, and try on every notification (and every
        SEMAPHORE_RECHECK) until a lane is got at session level; its number."""
        request = self.request
        lanes.listen()
        enter = True
        while True:
            lane = lanes.fetchval(query("semaphore_wait_try"), request.key, request.limit,
                                        enter, None)
            enter = False
            if lane is not None:
                lanes.forget()  # the server stopped listening in the same statement
                return int(lane)
            pause = self._recheck()
            if deadline is not None:
                pause = min(pause, deadline - time.monotonic())
                if pause <= 0:
                    raise request.timed_out()
            lanes.wait(pause)

    def _abandon_sync(
        self, session: SyncTxSession, lanes: SyncLaneConn, *, adopting: bool = False,
    ) -> None:
        """Undo a wait: no transaction, no lane, no waiting room, no LISTEN; bounded.
        A connection that cannot be made so is discarded."""
        try:
            bounded_sync(session, self._undo_wait_sync, session, lanes, adopting)
        except CleanupTimeout as exc:
            log.warning("pgcoord: %s; the connection was closed", exc)
        except Exception as exc:
            log.warning("pgcoord: discarding the connection after a failed semaphore cleanup: %r",
                        exc)
            try:
                session.discard()
            except Exception as close_exc:
                log.warning("pgcoord: closing the connection failed too: %r", close_exc)

    def _undo_wait_sync(
        self, session: SyncTxSession, lanes: SyncLaneConn, adopting: bool,
    ) -> None:
        # Always: a BEGIN cancelled in flight may not show as a transaction yet.
        session.rollback()
        freed = lanes.fetchval(query("semaphore_wait_abandon"), self.request.key)
        lanes.forget()
        if adopting and not freed:
            # The adopt ran (the lane was the transaction's, freed by the rollback,
            # which the abandon could not see): tell the next waiter.
            lanes.fetchval(query("semaphore_wake"), self.request.key)

    def _end_sync(self, session: SyncTxSession, *, rollback: bool) -> None:
        """After the COMMIT (or a rollback, here) that freed the lane: wake a waiter
        if any is in the waiting room, then give back; bounded, as a release is.
        (No NOTIFY rides on the transaction itself: a commit that sends one takes
        a database-wide lock, see sql/0005_semaphores.up.sql.)"""
        done = False
        try:
            bounded_sync(session, self._wake_sync, session, rollback)
            done = True
        except CleanupTimeout as exc:
            log.warning("pgcoord: %s; the connection was closed", exc)
        except Exception as exc:
            log.warning("pgcoord: waking semaphore waiters after a release failed: %r", exc)
        finally:
            release_sync(session, rollback=not done)

    def _wake_sync(self, session: SyncTxSession, rollback: bool) -> None:
        if rollback:
            session.rollback()
        driver = session.driver_connection()
        if SyncLaneConn.can_wait_on(driver):  # one round trip, outside any transaction
            SyncLaneConn(driver, self.request.key).fetchval(
                query("semaphore_wake"), self.request.key)
        else:
            session.run_autocommit(query("semaphore_wake"), (self.request.key,))
