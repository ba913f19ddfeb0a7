"""Recording the ends of runs, many per statement.

A replica that starts thousands of slots in one tick (10,000 tenants' schedules
on the same minute) would otherwise send one statement per run to record it,
and the pool's queue of records would outlast the bound on each. Runs that end
in the same turn of the event loop, or while a batch is on its way, share one
``schedule_finish`` statement.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

from .._core.aio import CLEANUP_TIMEOUT, finish_despite_cancel
from .._core.queries import query
from .._drivers import run_statement

FINISH_BATCH = 2000

#: (job, slot_at, runner, attempt, state, reason, error), as for job_finish.
Entry = tuple[str, dt.datetime, str, int, str, str | None, str | None]


class Finisher:
    """Queues run ends and sends them in batches, from one task at a time that
    ends when the queue is empty (and that ``close()`` stops)."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._queue: list[tuple[Entry, asyncio.Future[bool]]] = []
        self._task: asyncio.Task[None] | None = None

    async def finish(self, entry: Entry) -> bool:
        """Record one run's end; False when its slot was no longer this attempt's."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        item = (entry, done)
        self._queue.append(item)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush(), name="pgcoord-job-finisher")
        try:
            return await done
        except asyncio.CancelledError:
            if item in self._queue:  # not sent yet: never send it
                self._queue.remove(item)
            raise

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # runs that end in this same turn join the batch
        while self._queue:
            batch = self._queue[:FINISH_BATCH]
            del self._queue[:FINISH_BATCH]
            entries = [e for e, _ in batch]
            try:
                # Bounded like any record: a batch held up (a row lock, a server that
                # does not answer) is cancelled on the server, and its runs' claims
                # expire, rather than holding up every later record.
                row = await finish_despite_cancel(run_statement(
                    self._source, query("schedule_finish"),
                    tuple([e[i] for e in entries] for i in range(7))), bound=CLEANUP_TIMEOUT)
            except BaseException as exc:
                for _, fut in batch:
                    if not fut.done():
                        if isinstance(exc, asyncio.CancelledError):
                            fut.cancel()
                        else:
                            fut.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            done = row[0] if row is not None else None
            for index, (_, fut) in enumerate(batch):
                if not fut.done():
                    fut.set_result(bool(done[index]) if done is not None else False)

    async def close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
