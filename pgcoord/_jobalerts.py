"""Silent failure: a schedule with no success in its last K expected slots.

Expected slots are worked out from the schedule's expression, not read from
job_slots, so a schedule whose slots are missed, or that no replica runs at
all, counts as failing just as one whose runs raise.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from typing import Any

from . import metrics
from ._cron import Job, previous_slots
from ._drivers import run_statement
from ._queries import query

log = logging.getLogger("pgcoord.scheduler")


class FailingWatch:
    """Which schedules fail, remembered between looks so that each start and end
    of a failing spell is logged once."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.failing: dict[str, str] = {}  # name -> handler

    async def check(self, source: Any, specs: list[Job], now: dt.datetime) -> list[str]:
        names: list[str] = []
        firsts: list[dt.datetime] = []
        # Per expression, not per schedule: thousands of tenants' schedules share a
        # few, and each walk back over one costs tens of microseconds.
        walked: dict[tuple[str, str], list[dt.datetime]] = {}
        for spec in specs:
            key = (spec.expr, spec.tz.key)
            last_k = walked.get(key)
            if last_k is None:
                last_k = walked[key] = previous_slots(spec.expr, spec.tz, now, self.expected)
            # Only schedules old enough to have had K slots are judged.
            if len(last_k) == self.expected and spec.registered_at is not None \
                    and last_k[-1] > spec.registered_at:
                names.append(spec.name)
                firsts.append(last_k[-1])
        found: list[str] = []
        if names:
            row = await run_statement(source, query("schedule_failing"), (names, firsts))
            found = sorted(row[0] or []) if row is not None else []
        handlers = {spec.name: spec.handler or spec.name for spec in specs}
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
