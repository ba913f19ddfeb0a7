"""A tick's decisions over many schedules, with no I/O: which schedules are due,
the entries of the ``schedule_decide`` statements and their batches, what each
schedule has decided once the answer is in, when to look again, and the slots of
a backfill. The loop (``loop``) sends and receives; every choice is made here,
on instants it is given (a test's clock is as good as the database's).

One schedule's own slots (which instants, which run, which are missed) are
``cron.Job.decide``'s.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Iterable
from typing import Any

from .._core.aio import backoff_delay, jittered
from .cron import Job, next_slot, slots_between

UTC = dt.UTC
# Entries per schedule_decide statement: a tick that finds more due (10,000
# schedules on the same minute) sends several, each bounded in time, in an
# order of its own, so that racing replicas mostly win different batches and
# the runs spread over them.
DECIDE_BATCH = 500
TINY = dt.timedelta(microseconds=1)
BACKFILL_MAX = 10_000  # slots per backfill() call
# After a failed tick (the database gone, a terminated session) the loop waits
# this long, doubling per failure up to BACKOFF_MAX, with jitter, and goes on.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0

#: One slot to decide: (job, at, version, act, reason, on_overlap, claim_ms).
Entry = tuple[str, dt.datetime, int, str, str | None, str, int]


def due(specs: Iterable[Job], now: dt.datetime) -> tuple[list[Job], list[Job]]:
    """The schedules with a slot due at ``now``: those decided at once, and those
    with a jitter (each decided after a wait of its own)."""
    found = [s for s in specs if s.next_due is not None and s.next_due <= now]
    return [s for s in found if not s.jitter], [s for s in found if s.jitter]


def entries(specs: list[Job], now: dt.datetime) -> tuple[list[list[Entry]], dict[str, dt.datetime]]:
    """The slots of ``specs`` due at ``now``, as entries grouped by schedule, and the
    latest slot each schedule decides with them."""
    groups: list[list[Entry]] = []
    decided: dict[str, dt.datetime] = {}
    for spec in specs:
        todo, last = spec.decide(now)
        on_overlap = ("run" if spec.allow_overlap
                      else "wait" if spec.catch_up == "all" else "skip")
        if on_overlap == "wait":
            # A backlog runs one slot after another: the second run of this
            # batch would only wait, so it and what follows wait for a later tick.
            runs = [at for at, act, _ in todo if act == "run"]
            if len(runs) > 1:
                todo = [t for t in todo if t[0] < runs[1]]
                last = runs[1] - TINY
        ms = int(spec.claim_ttl * 1000)
        if todo:
            groups.append([(spec.name, at, spec.version, act, reason, on_overlap, ms)
                           for at, act, reason in todo])
        decided[spec.name] = last
    return groups, decided


def batches(groups: list[list[Entry]]) -> list[list[Entry]]:
    """The entries in batches of about DECIDE_BATCH, a job's entries never split
    (schedule_decide looks at overlaps within a batch), in a random order."""
    found: list[list[Entry]] = [[]]
    for group in groups:
        if found[-1] and len(found[-1]) + len(group) > DECIDE_BATCH:
            found.append([])
        found[-1].extend(group)
    random.shuffle(found)
    return [b for b in found if b]


def settle(specs: list[Job], decided: dict[str, dt.datetime], waiting: dict[str, dt.datetime],
           stale: set[str]) -> bool:
    """Move each schedule on past what it decided (``entries``), or up to its first
    slot that waits for a run still going; True if one of them was ``stale`` (changed
    since it was loaded: reload, and decide its slots again)."""
    changed = False
    for spec in specs:
        if spec.name in stale:
            changed = True
        elif spec.name in waiting:
            spec.after = min(decided[spec.name], waiting[spec.name] - TINY)
            spec.next_due = waiting[spec.name]
        else:
            spec.after = max(spec.after or decided[spec.name], decided[spec.name])
            spec.next_due = spec.next_after(spec.after)
    return changed


def next_wake(specs: Iterable[Job], now: dt.datetime, max_sleep: float) -> float:
    """When (epoch seconds) to look again: the next slot due, ``max_sleep`` at most."""
    wake: float = now.timestamp() + max_sleep
    for spec in specs:
        if spec.next_due is not None:
            wake = min(wake, spec.next_due.timestamp())
    return wake


def owed_runs(owed: list[tuple[Job, Any, Any, Any]]) -> list[bool]:
    """For each owed run (schedule, slot, slot_after, slot_until), whether it runs. A
    resume's run is owed only if the expression fired in the pause (slot_after,
    slot_until]; a trigger's (no pause) always is."""
    return [after is None or until is None
            or next_slot(spec.expr, spec.tz, after.astimezone(UTC)) <= until.astimezone(UTC)
            for spec, _, after, until in owed]


def upcoming(spec: Job, after: dt.datetime, n: int) -> list[dt.datetime]:
    """The next ``n`` instants of ``spec`` after ``after`` (aware, UTC)."""
    at = after.astimezone(UTC)
    runs = []
    for _ in range(n):
        at = spec.next_after(at)
        runs.append(at)
    return runs


def check_range(start: Any, end: Any) -> None:
    """ValueError unless [start, end] is a range of aware datetimes."""
    for what, value in (("start", start), ("end", end)):
        if not isinstance(value, dt.datetime) or value.utcoffset() is None:
            raise ValueError(f"backfill {what} must be an aware datetime, got {value!r}")
    if start > end:
        raise ValueError(f"backfill start {start} is after its end {end}")


def backfill_slots(spec: Job, start: dt.datetime, end: dt.datetime, now: dt.datetime,
                   ) -> list[dt.datetime]:
    """The slots of ``spec`` in [start, end], a range past at ``now``, BACKFILL_MAX at most
    (ValueError beyond, or for a range that is not past)."""
    if end > now:
        raise ValueError(f"backfill end {end} is in the future (database clock {now}): "
                         "the scheduler runs slots as they come due")
    slots = slots_between(spec.expr, spec.tz, start.astimezone(UTC) - TINY,
                          end.astimezone(UTC), limit=BACKFILL_MAX + 1)
    if len(slots) > BACKFILL_MAX:
        raise ValueError(f"backfill of {spec.name!r} from {start} to {end} is more than "
                         f"{BACKFILL_MAX} slots; split the range")
    return slots


def backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed ticks in a row: doubling, capped, jittered
    (so that replicas cut off together do not come back in step)."""
    return jittered(backoff_delay(max(1, failures), BACKOFF_FIRST, BACKOFF_MAX))
