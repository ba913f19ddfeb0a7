"""Jittered decisions, beside the loop: a schedule with ``jitter=`` has each due
slot decided after a random wait of its own, in a task of its own, so that the
tick (and every other schedule's slots) never waits for it.

While a schedule's wait is on, the loop neither decides it nor wakes for it:
each slot is decided once, by its task, on the database clock as the wait ends.
``stop()`` cancels the waits still on and lets a decision already sent finish
(its claims become runs, which the scheduler's drain waits for).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

from .._core.aio import CLEANUP_TIMEOUT, CleanupTimeout, Supervisor, finish_despite_cancel
from .cron import Job

log = logging.getLogger("pgcoord.scheduler")


class Jitters:
    """The waits going on, by schedule name. ``decide(name)`` decides the slots of
    schedule ``name`` that are due when it is called; ``wake`` is the loop's, set as
    each wait ends so that the loop looks at that schedule again."""

    def __init__(self, decide: Callable[[str], Awaitable[None]], wake: asyncio.Event) -> None:
        self._decide = decide
        self._wake = wake
        self._tasks = Supervisor("scheduler jitter", log)
        self._waiting: set[str] = set()

    def __len__(self) -> int:
        return len(self._waiting)

    def busy(self, name: str) -> bool:
        """Whether schedule ``name`` has a wait (or its decision) going on."""
        return name in self._waiting

    def start(self, spec: Job) -> None:
        """Decide ``spec``'s due slots after a wait of up to its jitter (unless one is on)."""
        if spec.name in self._waiting:
            return
        self._waiting.add(spec.name)
        self._tasks.spawn(self._wait_then_decide(spec.name, random.uniform(0, spec.jitter)),
                          f"pgcoord-scheduler-jitter:{spec.name}")

    async def _wait_then_decide(self, name: str, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
            # Once sent, a decision is let finish even if stop() comes meanwhile: what
            # it claimed is started, not left to expire.
            await finish_despite_cancel(self._decide(name), bound=CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("scheduler: a jittered decision of %r took over %.0f s; the next tick"
                        " decides its slots", name, CLEANUP_TIMEOUT)
        except Exception as exc:  # the next tick decides these slots again
            log.warning("scheduler: deciding the slots of %r after its jitter failed: %r", name, exc)
        finally:
            self._waiting.discard(name)
            self._wake.set()

    def pending(self) -> list[asyncio.Future[object]]:
        return self._tasks.pending()

    async def stop(self) -> None:
        """Cancel every wait and wait for the tasks to end."""
        await self._tasks.stop()
        self._waiting.clear()
