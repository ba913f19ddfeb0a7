"""asyncio helpers for cleanup that must finish even when the caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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
