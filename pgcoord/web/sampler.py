"""The one sampler of a process: it reads the catalogue at most once per interval,
whatever the number of open pages, and tells them when what they show changed.

``pg_locks`` copies the server's lock table under its partition locks, so 50 open
pages must cost one reading a second, not 50. A page's own GET takes the latest
sample when it is fresh, else waits for the one reading in flight (or starts it).
The loop runs only while some page listens (server-sent events): it starts with
the first and ends after the last has gone, and ``stop()`` ends it at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from .sample import Sample

log = logging.getLogger("pgcoord.web")

#: Seconds between two readings, at least.
INTERVAL = 1.0


class Sampler:
    def __init__(self, read: Callable[[], Coroutine[Any, Any, Sample]], *,
                 interval: float = INTERVAL) -> None:
        self._read = read
        self.interval = interval
        self._sample: Sample | None = None
        self._started_at = -float("inf")  # monotonic start of the latest reading
        self._reading: asyncio.Task[Sample] | None = None
        self._listeners = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._news = asyncio.Event()
        #: Readings made, and loops started (tests and the benchmark count them).
        self.readings = 0
        self.loops_started = 0

    @property
    def listeners(self) -> int:
        return self._listeners

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def current(self) -> Sample:
        """The latest sample if it is younger than the interval, else a fresh one
        (shared with every caller that asks meanwhile)."""
        if self._sample is not None and time.monotonic() - self._started_at < self.interval:
            return self._sample
        return await self._refresh()

    async def _refresh(self) -> Sample:
        if self._reading is None or self._reading.done():
            wait = self._started_at + self.interval - time.monotonic()
            if wait > 0 and self._sample is not None:
                return self._sample
            self._started_at = time.monotonic()
            self.readings += 1
            self._reading = asyncio.get_running_loop().create_task(self._read(), name="pgcoord.web read")
            self._reading.add_done_callback(self._took)
        # Shielded: a page that goes away must not cancel the reading others await.
        return await asyncio.shield(self._reading)

    def _took(self, task: asyncio.Task[Sample]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        sample = task.result()
        changed = self._sample is None or sample.version != self._sample.version
        self._sample = sample
        if changed:
            self._news.set()
            self._news = asyncio.Event()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[Callable[[str, float], Awaitable[Sample]]]:
        """For an open page: starts the loop if it is the first; yields
        ``next_change(version, timeout)``, which returns the latest sample once its
        version differs from ``version`` (or whatever it is after ``wait`` seconds)."""
        self._listeners += 1
        if not self.running:
            self.loops_started += 1
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), name="pgcoord.web sampler")

        async def next_change(version: str, wait: float) -> Sample:
            news = self._news
            if self._sample is None or self._sample.version == version:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(news.wait(), wait)
            return await self.current()

        try:
            yield next_change
        finally:
            self._listeners -= 1

    async def _loop(self) -> None:
        try:
            while self._listeners > 0:
                try:
                    await self._refresh()
                except Exception:  # a reading records its own failure; this is a bug
                    log.exception("pgcoord.web: the sampler's reading failed")
                await asyncio.sleep(max(0.0, self._started_at + self.interval - time.monotonic()))
        finally:
            self._loop_task = None if self._loop_task is asyncio.current_task() else self._loop_task

    async def stop(self) -> None:
        """End the loop and any reading in flight (the app's shutdown)."""
        for task in (self._loop_task, self._reading):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._loop_task = None
