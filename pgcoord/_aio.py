"""asyncio helpers for cleanup that must finish even when the caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar, cast

T = TypeVar("T")

# How long a rollback or a give-back may take before the connection is
# discarded instead. Bounded so that a cancelled caller is never held long.
CLEANUP_TIMEOUT = 5.0


async def finish_despite_cancel(aw: Awaitable[T]) -> T:
    """Run ``aw`` to completion even if the calling task is cancelled meanwhile.

    A cancellation that arrives during the cleanup is delivered once the cleanup
    is over, so the caller still sees ``CancelledError`` but never leaves a lock
    or a dirty connection behind. ``aw`` must bound its own duration.
    """
    if asyncio.iscoroutine(aw):
        # Most cleanups (a connection given back to an idle pool) finish without
        # ever suspending. Run the first step here, where no cancellation can
        # reach it, and pay for a shielded task only if the cleanup has to wait.
        coro = cast(Coroutine[Any, Any, T], aw)
        try:
            waiting_on = coro.send(None)
        except StopIteration as finished:
            return cast(T, finished.value)
        task: asyncio.Future[T] = asyncio.ensure_future(_resume(coro, waiting_on))
    else:
        task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                cancelled = True
    if cancelled:
        if not task.cancelled() and task.exception() is None:
            raise asyncio.CancelledError
        raise asyncio.CancelledError from (None if task.cancelled() else task.exception())
    return task.result()


async def _resume(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    """Carry on a coroutine that was stepped by hand and is suspended on
    ``waiting_on``, what it yielded to the event loop: a future, or None for a
    bare yield. This does for it what an asyncio task would have done."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
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
