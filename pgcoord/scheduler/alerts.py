"""Silent failure: a schedule with no success in its last K expected slots.

Expected slots are worked out from the schedule's expression, not read from
job_slots, so a schedule whose slots are missed, or that no replica runs at
all, counts as failing just as one whose runs raise. Every replica judges every
schedule not paused (it cannot know which handlers the others register), from
its creation, last change of expression or last resume: the slots of a pause
are not failures. A run of one of the K slots still going is not a failure
by itself (nor is a slow run whose success lands in a later slot's span), unless
the latest run that ended failed: a job that fails after running most of its
period, or for longer than K periods, alerts like one that fails at once. A run
going since before the span (hung, or slower than K periods) does not clear it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import Counter
from typing import Any

from .._core.queries import query
from .._drivers import run_statement
from ..observability import metrics
from .cron import check_expr, check_zone, previous_slots
from .runner import as_utc

log = logging.getLogger("pgcoord.scheduler")


class FailingWatch:
    """Which schedules fail, remembered between looks so that each start and end
    of a failing spell is logged once."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.failing: dict[str, str] = {}  # name -> handler

    async def check(self, source: Any) -> list[str]:
        row = await run_statement(source, query("schedule_watch"), ())
        assert row is not None
        now = as_utc(row[0])
        watched = [] if row[1] is None else list(zip(*row[1:], strict=True))
        # In a thread: 10,000 schedules of distinct expressions cost ~1 s of walking
        # back, which would hold up the event loop (every tick, every heartbeat).
        names, firsts = await asyncio.to_thread(self._judged, watched, now)
        found: list[str] = []
        if names:
            failing = await run_statement(source, query("schedule_failing"), (names, firsts))
            found = sorted(failing[0] or []) if failing is not None else []
        return self._report(watched, found)

    def _judged(self, watched: list[tuple[Any, ...]], now: dt.datetime,
                ) -> tuple[list[str], list[dt.datetime]]:
        """The schedules old enough to judge, each with the first of its last K
        expected slots."""
        names: list[str] = []
        firsts: list[dt.datetime] = []
        # Per expression, not per schedule: thousands of tenants' schedules share a
        # few, and each walk back over one costs tens of microseconds.
        walked: dict[tuple[str, str], list[dt.datetime]] = {}
        for name, _, expr, tz, since in watched:
            key = (expr, tz)
            last_k = walked.get(key)
            if last_k is None:
                try:
                    zone = check_zone(tz)
                    check_expr(expr, zone)
                    last_k = previous_slots(expr, zone, now, self.expected)
                except ValueError:  # a row written by hand that no replica can read
                    last_k = []
                walked[key] = last_k
            # Only schedules old enough (since the last start of counting) to have
            # had K slots are judged.
            if len(last_k) == self.expected and last_k[-1] > as_utc(since):
                names.append(name)
                firsts.append(last_k[-1])
        return names, firsts

    def _report(self, watched: list[tuple[Any, ...]], found: list[str]) -> list[str]:
        handlers = {name: handler for name, handler, *_ in watched}
        for name in found:
            if name not in self.failing:
                self.failing[name] = handlers[name]
                metrics.job_failing(name, handlers[name], self.expected)
        for name in [n for n in self.failing if n not in found]:
            metrics.job_recovered(name, self.failing.pop(name))
        counts = Counter(self.failing.values())
        for handler in set(handlers.values()) | set(counts):
            metrics.jobs_failing(handler, counts.get(handler, 0))
        return found
