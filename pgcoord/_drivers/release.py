"""Ending pgcoord's use of a connection: rollback and give-back, bounded.

A cleanup that does not finish within ``CLEANUP_TIMEOUT`` (a silent network, a
pool reset that hangs) must not hold the caller or hand it a CancelledError it
never asked for: past the bound the connection is cut (the server then ends the
session and its locks) and the caller keeps its own outcome.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from .._core import aio as _aio
from .base import AsyncTxSession, SyncTxSession

log = logging.getLogger("pgcoord")

P = ParamSpec("P")
T = TypeVar("T")


async def bounded_async(session: AsyncTxSession, step: Callable[P, Awaitable[T]], /,
                        *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the cleanup ``step(*args, **kwargs)`` to its end, also when the caller is
    cancelled meanwhile, for at most ``CLEANUP_TIMEOUT``: past it the session is
    cut and ``CleanupTimeout`` raised (the step's own except clauses still run, in
    the task it was left in). See ``_aio.finish_despite_cancel``."""
    return await _aio.finish_despite_cancel(step(*args, **kwargs), bound=_aio.CLEANUP_TIMEOUT,
                                            on_timeout=session.sever)


def bounded_sync(session: SyncTxSession, step: Callable[P, T], /,
                 *args: P.args, **kwargs: P.kwargs) -> T:
    """``bounded_async`` for a sync session: past ``CLEANUP_TIMEOUT`` the watchdog
    thread cuts the connection, so that a statement blocked in ``step`` returns with
    an error; the connection is then discarded and ``CleanupTimeout`` raised."""
    bound = _aio.CLEANUP_TIMEOUT
    guard = _watchdog.guard(bound, session.sever)
    try:
        result = step(*args, **kwargs)
    except BaseException as exc:
        if not guard.stop():
            raise
        _discard_sync(session)
        if not isinstance(exc, Exception):
            raise
        raise _aio.CleanupTimeout(f"cleanup did not finish within {bound} s; abandoned") from exc
    if guard.stop():
        _discard_sync(session)
        raise _aio.CleanupTimeout(f"cleanup did not finish within {bound} s; abandoned")
    return result


async def release_async(session: AsyncTxSession, *, rollback: bool) -> None:
    """Roll back (when asked) and give the connection back, within
    ``CLEANUP_TIMEOUT``; past it the connection is cut and left to its pool.

    Raises nothing but the caller's own ``CancelledError`` (if the caller was
    cancelled meanwhile), so that the caller keeps its own outcome: the body's
    exception, or a normal return.
    """
    if not rollback and session.checkin_bounded_by_driver:
        await session.checkin()
        return
    try:
        await bounded_async(session, _rollback_and_checkin, session, rollback)
    except _aio.CleanupTimeout as exc:
        log.warning("pgcoord: %s; the connection was closed", exc)


async def _rollback_and_checkin(session: AsyncTxSession, rollback: bool) -> None:
    # No timeout in here: the first step runs on the caller's task (see
    # finish_despite_cancel), where a timeout would cancel the caller.
    try:
        if rollback:
            try:
                await session.rollback()
            except BaseException as exc:  # also when abandoned past the bound
                log.warning("pgcoord: discarding the connection after a failed rollback: %r", exc)
                try:
                    await session.discard()
                except Exception as close_exc:
                    log.warning("pgcoord: closing the connection failed too: %r", close_exc)
                if not isinstance(exc, Exception):
                    raise
    finally:
        try:
            await session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)


def release_sync(session: SyncTxSession, *, rollback: bool) -> None:
    """``release_async`` for a sync session: past ``CLEANUP_TIMEOUT`` a watchdog
    shuts the socket down, so that a blocked rollback returns with an error and
    the connection is closed instead of given back.

    Written by hand, not generated: the watchdog's guard ends before the give-back,
    so that a connection it cut is discarded first and never goes back to its pool.

    Only a rollback is watched (about 12% of a sync lock's time went to the
    watchdog): after a COMMIT the connection is idle, and giving an idle psycopg
    connection back to a psycopg or SQLAlchemy pool does no I/O.
    """
    if not rollback:
        try:
            session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)
        return
    guard = _watchdog.guard(_aio.CLEANUP_TIMEOUT, session.sever)
    try:
        try:
            session.rollback()
        except BaseException as exc:
            log.warning("pgcoord: discarding the connection after a failed rollback: %r", exc)
            _discard_sync(session)
            if not isinstance(exc, Exception):
                raise
    finally:
        if guard.stop():
            log.warning("pgcoord: rollback did not finish within %s s; the connection was closed",
                        _aio.CLEANUP_TIMEOUT)
            _discard_sync(session)
        try:
            session.checkin()
        except Exception as exc:
            log.warning("pgcoord: giving the connection back failed: %r", exc)


def _discard_sync(session: SyncTxSession) -> None:
    try:
        session.discard()
    except Exception as exc:
        log.warning("pgcoord: closing the connection failed too: %r", exc)


class _Guard:
    """One guarded cleanup: ``action`` runs at the deadline unless ``stop()`` came first."""

    __slots__ = ("_action", "_lock", "done", "fired")

    def __init__(self, action: Callable[[], object]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self.done = self.fired = False

    def fire(self) -> None:
        # Under the lock, so that stop() returns only once the action is over
        # (the connection is not closed under a socket shutdown in progress).
        with self._lock:
            if self.done:
                return
            self.done = self.fired = True
            try:
                self._action()
            except Exception as exc:
                log.warning("pgcoord: cutting a connection failed: %r", exc)

    def stop(self) -> bool:
        """End the guard; whether its action ran."""
        with self._lock:
            self.done = True
            return self.fired


class _Watchdog:
    """One daemon thread for every sync cleanup's deadline: a thread per cleanup
    would cost more than a try-lock that found the lock busy."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Guard]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def guard(self, bound: float, action: Callable[[], object]) -> _Guard:
        guard = _Guard(action)
        deadline = time.monotonic() + bound
        with self._cond:
            first = not self._heap or deadline < self._heap[0][0]
            heapq.heappush(self._heap, (deadline, next(self._order), guard))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pgcoord-watchdog", daemon=True)
                self._thread.start()
            elif first:
                self._cond.notify()
        return guard

    def _run(self) -> None:
        while True:
            due: list[_Guard] = []
            with self._cond:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    guard = heapq.heappop(self._heap)[2]
                    if not guard.done:
                        due.append(guard)
                if not due:
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
            for guard in due:
                guard.fire()


_watchdog = _Watchdog()
