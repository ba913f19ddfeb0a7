"""From decisions to runs: the claims a replica makes on slots, and the run of
each slot it wins.

The loop hands over the schedules due (``decide``), the runs owed (``take_owed``)
and the schedules whose lost claims to look for (``recover``); a trigger or a
backfill hands over one slot at a time. What to claim is worked out in ``plan``,
sent through ``store``; each claim won becomes a run in ``runs``, with the
instant its statement was sent as the start of the claim's trust window.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

from . import plan
from .cron import Job
from .runner import Slot
from .runs import Runs
from .store import Store

log = logging.getLogger("pgcoord.scheduler")
# A trigger or backfill of a job that must not overlap, while another run of it goes,
# asks again this often (seconds) until that run ends.
OVERLAP_POLL = 0.2


class Claims:
    """Claims made through ``store``, runs started on ``runs``."""

    def __init__(self, store: Store, runs: Runs) -> None:
        self._store = store
        self._runs = runs
        #: The schedules whose next slot waits for a run still going on (catch_up="all",
        #: no overlap), by name, with that slot: the loop does not wake for them (the
        #: run's end wakes it), or a backlog behind a long run would spin it.
        self.waiting: dict[str, dt.datetime] = {}

    async def decide(self, specs: list[Job], now: dt.datetime, runner: str) -> bool:
        """Decide the due slots of ``specs`` in a statement per DECIDE_BATCH: claim those
        to run, record the others missed or skipped; start what ``runner`` claimed.
        True if a schedule changed since it was loaded (its slots are decided again
        after a reload). A failed batch raises; the next tick decides those slots
        again (a slot claimed meanwhile by anyone is not claimed twice: the primary key)."""
        groups, decided = plan.entries(specs, now)
        by_name = {spec.name: spec for spec in specs}
        waiting: dict[str, dt.datetime] = {}
        stale: set[str] = set()
        for part in plan.batches(groups):
            sent = time.monotonic()
            for job, at, state, attempt in await self._store.decide(part, runner):
                spec = by_name[job]
                if state == "running":
                    self._runs.start(spec, Slot(job, at, int(attempt), args=spec.args), sent, runner)
                elif state == "waiting":
                    waiting[job] = min(at, waiting.get(job, at))
                elif state == "stale":
                    stale.add(job)
                else:
                    log.info("job %r slot %s skipped: the previous run is still going", job, at)
        for spec in specs:
            self.waiting.pop(spec.name, None)
        self.waiting.update(waiting)
        return plan.settle(specs, decided, waiting, stale)

    async def take_owed(self, mine: list[tuple[Job, Any, Any, Any]], runner: str) -> None:
        """Take the runs owed (schedule, slot, slot_after, slot_until) that are owed
        (``plan.owed_runs``), drop the others unrun, and start those taken."""
        runs = plan.owed_runs(mine)
        sent = time.monotonic()
        taken = await self._store.take_owed([m[0] for m in mine], [m[1] for m in mine], runs, runner)
        by_name = {m[0].name: m[0] for m in mine}  # not the loop's: a reload may replace it
        for job, at, attempt, manual in taken:
            spec = by_name[job]
            self._runs.start(spec, Slot(job, at, attempt, manual=manual, args=spec.args), sent, runner)

    async def recover(self, specs: list[Job], runner: str) -> None:
        """Record the lost claims of ``specs`` abandoned, or (``on_crash="retry"``) take
        them over as the next attempt and start those."""
        sent = time.monotonic()
        taken = await self._store.recover(specs, runner)
        by_name = {s.name: s for s in specs}  # not the loop's: a reload may replace it
        for job, at, attempt in taken:
            spec = by_name[job]
            log.warning("job %r slot %s: runner lost, retrying as attempt %d", job, at, attempt)
            self._runs.start(spec, Slot(job, at, attempt, args=spec.args), sent, runner)

    async def run_now(self, spec: Job, runner: str) -> Slot:
        """Claim a manual slot of ``spec`` (now) and run it here, to its end. A job that
        must not overlap waits until no other run of it is going."""
        while True:
            sent = time.monotonic()
            claimed = await self._store.claim_now(spec, runner)
            if claimed is not None:
                break
            await asyncio.sleep(OVERLAP_POLL)
        at, attempt = claimed
        slot = Slot(spec.name, at, attempt, manual=True, args=spec.args)
        await self._runs.execute(spec, slot, sent, runner)
        return slot

    async def run_slot(self, spec: Job, at: dt.datetime, runner: str) -> Slot | None:
        """Claim slot ``at`` of ``spec`` and run it here, to its end; None (nothing run)
        if the slot has a row already. A slot in a pause of the schedule is recorded
        skipped (reason 'paused'), as the loop records it; a job that must not overlap
        waits until no other run of it is going."""
        if spec.is_paused_slot(at):
            entry = (spec.name, at, spec.version, "skipped", "paused", "skip",
                     int(spec.claim_ttl * 1000))
            await self._store.decide([entry], runner)
            return None
        while True:
            sent = time.monotonic()
            attempt = await self._store.claim(spec, at, runner)
            if attempt != "waiting":
                break
            await asyncio.sleep(OVERLAP_POLL)
        if not isinstance(attempt, int):
            return None
        slot = Slot(spec.name, at, attempt, args=spec.args)
        await self._runs.execute(spec, slot, sent, runner)
        return slot
