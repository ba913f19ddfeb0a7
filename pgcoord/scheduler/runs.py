"""The runs a replica has going, as one object the loop holds: the runner
(``runner.SlotRunner``: one claimed slot's body, heartbeat, timeout and record)
with the state it works on — the runs by slot, the turns of transactional runs,
the finisher that records their ends — and what is done to all of them at once:
cut off those of a member session that ended, stop them all.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

from .._core.aio import CLEANUP_TIMEOUT, CleanupTimeout, finish_despite_cancel
from .cron import Job
from .finisher import Finisher
from .runner import Run, Slot, SlotRunner, claim_tenure

log = logging.getLogger("pgcoord.scheduler")


class Runs(SlotRunner):
    """The slots this replica runs, by (job, slot instant): started by the loop, run
    to the end by a trigger or a backfill, stopped together by ``close()``."""

    def __init__(self, source: Any, capacity: int | None, wake: asyncio.Event) -> None:
        self._source = source
        # A transactional run holds a pool connection for its whole body; the
        # ticks, heartbeats and records need one more. So at most capacity - 1
        # such runs hold one at a time, and the rest wait their turn.
        self._tx_turns = (asyncio.Semaphore(capacity - 1)
                          if capacity is not None and capacity > 1 else None)
        self._finisher = Finisher(source)
        self._wake = wake  # set as each run ends: a backlog waiting for it may go on
        self._running: dict[tuple[str, dt.datetime], Run] = {}
        self._stopping = False

    @property
    def running(self) -> dict[tuple[str, dt.datetime], Run]:
        """The runs going on, by (job, slot instant)."""
        return self._running

    @property
    def stopping(self) -> bool:
        """Set while the scheduler stops: a body cancelled meanwhile ends ``stopped``."""
        return self._stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._stopping = value

    def start(self, spec: Job, slot: Slot, sent: float, runner: str) -> None:
        """Run ``slot``, claimed for ``runner`` by a statement sent at ``sent``
        (monotonic), in a task of its own."""
        self._start(spec, slot, sent, runner)

    async def execute(self, spec: Job, slot: Slot, sent: float, runner: str) -> None:
        """Run ``slot`` (claimed as for ``start()``) in the caller's task, until it has
        ended and its end is recorded."""
        await self._execute(Run(spec, slot, claim_tenure(spec, slot, sent), runner))

    def recording(self) -> dict[str, list[asyncio.Task[None]]]:
        """The runs whose body has ended and whose end is on its way to the database,
        by job: the database still says the slot is running. The job's next slot is
        decided once the record is in (the run's end wakes the loop), not skipped as
        an overlap of a run that is over."""
        ended: dict[str, list[asyncio.Task[None]]] = {}
        for run in self._running.values():
            if run.body is not None and run.body.done() and run.task is not None:
                ended.setdefault(run.spec.name, []).append(run.task)
        return ended

    def tasks(self) -> list[asyncio.Task[None]]:
        return [run.task for run in self._running.values() if run.task is not None]

    def cut_off_session(self, suffix: str) -> None:
        """The member session whose runner names end in ``suffix`` ended, and the
        claims tied to it with it: each run under one loses its claim (its body is
        cancelled until it ends by the run's own task)."""
        for run in list(self._running.values()):
            if run.runner.endswith(suffix):
                run.tenure.lose("the member's session, which the claim is tied to, ended")

    async def close(self) -> None:
        """Stop every run, then the finisher, each within its bound (what does not end
        in time is left behind: its claim expires)."""
        try:
            await finish_despite_cancel(self._stop_runs(), bound=2 * CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("scheduler: runs still going %.0f s after being cancelled were left"
                        " behind (their claims expire)", 2 * CLEANUP_TIMEOUT)
        try:
            await finish_despite_cancel(self._finisher.close(), bound=CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("scheduler: recording the last runs' ends was abandoned after %.0f s"
                        " (their claims expire)", CLEANUP_TIMEOUT)
