"""asyncio helpers for cleanup that must finish even when the caller is cancelled,
and must never hold the caller longer than its bound."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")

log = logging.getLogger("pgcoord")

# How long a rollback, a give-back, a release or a record may take before the
# cleanup is abandoned (and its connection discarded). Bounded so that a caller
# is never held long by a server that does not answer.
CLEANUP_TIMEOUT = 5.0

# Cleanups abandoned at their bound: cancelled, and left to run their own
# except/finally (which discards the connection) without anyone waiting. Kept
# here so that the event loop's weak reference is not the only one.
_abandoned: set[asyncio.Future[Any]] = set()


class CleanupTimeout(Exception):
    """A cleanup ran past its bound and was abandoned (internal: each call site
    turns it into a discarded connection and the caller's own outcome)."""


def _inline_first_step_works() -> bool:
    """Whether a coroutine stepped by hand yields the future it waits on, marked
    as asyncio's Task does expect (``_asyncio_future_blocking``). That private
    protocol is what lets a cleanup run its first step without a task; where an
    interpreter behaves differently, every cleanup gets a task of its own."""
    loop = asyncio.new_event_loop()
    try:
        fut: asyncio.Future[None] = loop.create_future()

        async def waiter() -> None:
            await fut

        coro = waiter()
        try:
            yielded = coro.send(None)
            ok = yielded is fut and getattr(yielded, "_asyncio_future_blocking", None) is True
        finally:
            coro.close()
        return ok
    finally:
        loop.close()


# From Python 3.12 on, asyncio.wait_for is built on asyncio.timeout(), which binds
# to the current task: a driver's wait_for inside a cleanup's first step (psycopg
# 3.2 polls with one) would be bound to the caller's task and could cancel it. So
# the inline first step is for 3.11 only; later versions pay for a task per cleanup.
INLINE_FIRST_STEP = sys.version_info < (3, 12) and _inline_first_step_works()


async def finish_despite_cancel(
    aw: Awaitable[T], *, bound: float | None = CLEANUP_TIMEOUT,
    on_timeout: Callable[[], object] | None = None,
) -> T:
    """Run the cleanup ``aw`` to completion even if the calling task is cancelled
    meanwhile, but for at most ``bound`` seconds.

    A cancellation that arrives during the cleanup is delivered once the cleanup
    is over (or abandoned), so the caller still sees the ``CancelledError`` it
    was sent but never leaves a lock or a dirty connection behind. Past the
    bound the cleanup is cancelled in its own task, where its except/finally
    clauses run without the caller waiting for them; ``on_timeout`` (which must
    not block: close a socket, mark a connection unusable) is called, and
    ``CleanupTimeout`` is raised, unless the caller was cancelled meanwhile.

    The bound is enforced here, on a task of the cleanup's own: cleanups must not
    use ``asyncio.timeout()`` themselves, since their first step runs on the
    caller's task and a timeout entered there would cancel the caller.
    """
    if INLINE_FIRST_STEP and asyncio.iscoroutine(aw):
        # Most cleanups (a connection given back to an idle pool) finish without
        # ever suspending. Run the first step here, where no cancellation can
        # reach it, and pay for a task only if the cleanup has to wait.
        coro = cast(Coroutine[Any, Any, T], aw)
        try:
            waiting_on = coro.send(None)
        except StopIteration as finished:
            return cast(T, finished.value)
        task: asyncio.Future[T] = asyncio.ensure_future(_resume(coro, waiting_on))
    else:
        task = asyncio.ensure_future(aw)
    deadline = None if bound is None else time.monotonic() + bound
    cancelled = False
    while not task.done():
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        try:
            # asyncio.wait never cancels what it waits on, so a cancellation of
            # the caller lands here and leaves the cleanup running.
            await asyncio.wait([task], timeout=remaining)
        except asyncio.CancelledError:
            cancelled = True
    if not task.done():
        _abandon(task)
        if on_timeout is not None:
            try:
                on_timeout()
            except Exception as exc:  # the cleanup is already abandoned; say so and go on
                log.warning("pgcoord: discarding after an abandoned cleanup failed: %r", exc)
        if cancelled:
            raise asyncio.CancelledError
        raise CleanupTimeout(f"cleanup did not finish within {bound} s; abandoned")
    if cancelled:
        if not task.cancelled() and task.exception() is None:
            raise asyncio.CancelledError
        raise asyncio.CancelledError from (None if task.cancelled() else task.exception())
    return task.result()


def _abandon(task: asyncio.Future[Any]) -> None:
    _abandoned.add(task)
    task.add_done_callback(_abandoned.discard)
    task.add_done_callback(consume_result)
    task.cancel("pgcoord: cleanup ran past its bound")


async def _resume(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    """Carry on a coroutine that was stepped by hand and is suspended on
    ``waiting_on``, what it yielded to the event loop: a future, or None for a
    bare yield. This does for it what an asyncio task would have done, including
    passing a cancellation of this task on to the coroutine."""
    while True:
        try:
            if waiting_on is None:
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError as exc:
                    waiting_on = coro.throw(exc)
                    continue
            elif not asyncio.isfuture(waiting_on):
                waiting_on = coro.throw(RuntimeError(f"cleanup yielded {waiting_on!r}, not a future"))
                continue
            else:
                waiting_on._asyncio_future_blocking = False
                try:
                    await asyncio.wait([waiting_on])
                except asyncio.CancelledError:
                    # As for a task: the awaited future is cancelled, and the
                    # coroutine sees that when it reads the outcome.
                    waiting_on.cancel()
            waiting_on = coro.send(None)
        except StopIteration as finished:
            return cast(T, finished.value)


# How often a task that went on after its cancellation is cancelled again.
RECANCEL_EVERY = 0.1


async def cancel_until_done(task: asyncio.Task[Any], *,
                            insist_from: float | Callable[[], float] = 0.0,
                            every: float = RECANCEL_EVERY, msg: str | None = None,
                            cancel_now: bool = True) -> int:
    """Cancel ``task`` (unless ``cancel_now`` is False: the caller just did) and wait
    until it has ended; from ``insist_from`` (monotonic time, or a function giving
    it, read again at each look) on, cancel it again every ``every`` seconds while
    it runs on. Returns how often it was cancelled again; never raises what the
    task raised.

    One cancellation is not always enough: a driver can turn it into an ordinary
    error (psycopg before its fix for issue #1435, in 3.2, raises the connection's
    ``OperationalError`` when the connection breaks during a cancelled statement),
    and code that retries on errors then goes on as if nothing had been asked of
    it. Where pgcoord has ended the term a task runs for (a lost lock, a closed
    trust window) it must end; ``insist_from`` lets a graceful stop give the
    task's own cleanup the time that is still safely ours first.
    """
    start = insist_from if callable(insist_from) else (lambda: insist_from)
    if cancel_now:
        task.cancel(msg)
    again = 0
    try:
        while not task.done():
            # Looked at every `every` seconds, since `insist_from` may move either way
            # (a renewal extends a trust window, a loss closes it).
            await asyncio.wait({task}, timeout=every)
            if not task.done() and time.monotonic() >= start():
                task.cancel(msg)
                again += 1
    except asyncio.CancelledError:
        task.cancel(msg)  # given up on (a bound, our own cancellation): one last ask
        raise
    return again


def keep_cancelling(task: asyncio.Task[Any], msg: str | None = None) -> None:
    """For a task whose waiter gives up on it (a bound reached, the waiter itself
    cancelled): go on cancelling it every ``RECANCEL_EVERY`` seconds until it ends,
    without anyone waiting. Kept alive here, as abandoned cleanups are; it ends
    with the task."""
    if task.done():
        return
    insisting = asyncio.ensure_future(cancel_until_done(task, msg=msg))
    _abandoned.add(insisting)
    insisting.add_done_callback(_abandoned.discard)
    insisting.add_done_callback(consume_result)


def consume_result(task: asyncio.Future[Any]) -> None:
    """Done-callback for an abandoned task: read its outcome so asyncio does not
    log "exception was never retrieved" for a failure we already acted on."""
    if not task.cancelled():
        task.exception()


def absorb_cancel() -> None:
    """Withdraw the cancellation request that woke the current task.

    Used where pgcoord itself cancelled a task (``stop()``, or a lost lock) and
    turns that into a normal return or its own exception, so that enclosing
    ``asyncio.timeout()`` blocks and task groups do not see a cancellation.
    """
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


#: Put on a subscriber's queue to end its ``Subscription``.
END_OF_STREAM: Any = object()


class Subscription(Generic[T]):
    """An async iterator over the items put on its queue, subscribed from its
    creation (not its first ``__anext__``), so nothing published in between is
    missed. The publisher keeps the set of queues and ends every subscription by
    putting ``END_OF_STREAM`` on each."""

    def __init__(self, subscribers: set[asyncio.Queue[Any]]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._subscribers = subscribers
        subscribers.add(self._queue)

    def __aiter__(self) -> Subscription[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._queue.get()
        if item is END_OF_STREAM:
            self.close()
            raise StopAsyncIteration
        return cast(T, item)

    def close(self) -> None:
        """Stop receiving items."""
        self._subscribers.discard(self._queue)


def backoff_delay(failures: int, first: float, cap: float) -> float:
    """The delay after ``failures`` failures in a row: ``first``, doubling, at most ``cap``
    (0 after none); before jitter."""
    return 0.0 if failures <= 0 else min(cap, first * 2.0 ** (failures - 1))


def jittered(delay: float) -> float:
    """A half to the whole of ``delay``, so that replicas that failed together do not
    try again together."""
    return delay * random.uniform(0.5, 1.0)


class Backoff:
    """How long to wait before trying again: ``first``, doubling at each failure up to
    ``cap``, and back to nothing after a success. Waits are jittered (a half to the
    whole of the delay) so that replicas that failed together do not retry together."""

    def __init__(self, first: float = 0.05, cap: float = 5.0) -> None:
        self.first, self.cap = first, cap
        self.failures = 0

    @property
    def delay(self) -> float:
        return backoff_delay(self.failures, self.first, self.cap)

    def reset(self) -> None:
        self.failures = 0

    def failed(self) -> float:
        """One more failure: the new delay (before jitter)."""
        self.failures += 1
        return self.delay

    def jittered(self) -> float:
        """The current delay, jittered: what to wait now."""
        return jittered(self.delay)

    async def sleep(self) -> None:
        """Wait out the current delay, jittered (at once after a success)."""
        if self.delay:
            await asyncio.sleep(self.jittered())


class Supervisor:
    """The owner of an object's background tasks: each is named, kept referenced
    until it ends, has its error logged unless someone collects it, and is cancelled
    and awaited by ``stop()``. Nothing pgcoord starts in the background is left
    without one."""

    def __init__(self, owner: str, logger: logging.Logger | None = None) -> None:
        self.owner = owner
        self._log = logger or log
        self._tasks: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str, *, collected: bool = False) -> asyncio.Task[T]:
        """Start ``coro`` as a task named ``name``. ``collected``: its owner reads its
        outcome itself, so an error is not logged here."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(consume_result if collected else self._report)
        return task

    def adopt(self, task: asyncio.Future[Any], *, collected: bool = False) -> None:
        """Own a task started elsewhere (``asyncio.ensure_future`` of a cleanup, say)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(consume_result if collected else self._report)

    def pending(self) -> list[asyncio.Future[Any]]:
        """The tasks still running (for an owner that waits for them, bounded)."""
        return [task for task in self._tasks if not task.done()]

    def cancel(self) -> None:
        """Cancel every task without waiting (from a synchronous unhook)."""
        for task in self._tasks:
            task.cancel()

    def _report(self, task: asyncio.Future[Any]) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            self._log.error("%s: background task %s failed", self.owner, name, exc_info=error)

    async def stop(self) -> None:
        """Cancel every task and wait until each has ended (their errors are not raised).
        A cancellation of the caller meanwhile is raised once they have all ended."""
        tasks, self._tasks = set(self._tasks), set()
        for task in tasks:
            task.cancel()
        caller = asyncio.current_task()
        asked = caller.cancelling() if caller is not None else 0
        cancelled = False
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                # The task ends cancelled either way: only the caller's own count of
                # cancellations tells whether it was cancelled too (a check of the
                # task alone lost that cancellation, and a Member's close() waited
                # for ever on a runner that had rejoined instead).
                if not task.cancelled() or (caller is not None and caller.cancelling() > asked):
                    cancelled = True
            except Exception:
                pass
        if cancelled:
            raise asyncio.CancelledError
