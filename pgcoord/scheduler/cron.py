"""Slot arithmetic, with no I/O: which instants a schedule fires at, which of
them to run or record missed, and the checks of a schedule's definition.

A schedule's expression is read in its own time zone by cronsim, which follows
Debian cron across daylight-saving changes: a time that occurs twice on the
fall-back night fires once (the first), and a time in the spring-forward gap
fires at the first instant after the gap. cronsim does so for five fields only;
a six-field expression (seconds first) with a fixed minute and hour gets the same
rules here (``_instants``): its minutes are those of the five-field expression,
and its seconds fall within each of them.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from cronsim.cronsim import Field

from .._core.checks import text

UTC = dt.UTC
CATCH_UP = ("latest", "none", "all")
ON_CRASH = ("skip", "retry")
# Slots are worked out and marked in batches of at most this many. With
# catch_up="all" a longer backlog (a per-second job after a long outage) is
# run over the next ticks; with "latest" and "none" every batch is decided in
# the same tick, so that what runs is the latest slot, not the latest of the
# first batch.
MAX_SLOTS_PER_TICK = 2000

JobFn = Callable[[Any], Coroutine[Any, Any, Any]]


def check_zone(tz: Any) -> ZoneInfo:
    if not isinstance(tz, str) or "\x00" in tz:
        raise ValueError(f"unknown time zone {tz!r}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ValueError(f"unknown time zone {tz!r}") from exc


def check_expr(expr: Any, zone: ZoneInfo) -> str:
    if not isinstance(expr, str):
        raise ValueError("cron expression must be a str")
    text(expr, "cron expression")
    if len(expr.split()) not in (5, 6):
        raise ValueError(f"cron expression {expr!r} must have 5 fields, or 6 with seconds first")
    try:
        next(iter(CronSim(expr, dt.datetime.now(zone))))
    except (CronSimError, StopIteration) as exc:
        raise ValueError(f"bad cron expression {expr!r}: {exc}") from exc
    return expr



_MINUTE = dt.timedelta(seconds=61)


def _instants(expr: str, zone: ZoneInfo, start: dt.datetime, *, reverse: bool = False,
              ) -> Iterator[dt.datetime]:
    """The instants of ``expr`` in ``zone`` strictly after ``start`` (or before it,
    ``reverse``), as cronsim walks them, with Debian's DST rules for six fields too.

    cronsim applies those rules (the wall clock, not elapsed time) only to five-field
    expressions whose minute and hour are fixed: ``0 30 2 * * *`` in Europe/Berlin
    fired 0 times on the spring-forward night and twice on the fall-back night, where
    ``30 2 * * *`` fires once each. Such an expression is walked here as its five-field
    minutes, each expanded by its seconds."""
    parts = expr.split()
    if (len(parts) != 6 or parts[1].startswith("*") or parts[2].startswith("*")
            or zone.key in ("UTC", "Etc/UTC")):
        yield from CronSim(expr, start.astimezone(zone), reverse=reverse)
        return
    secs = sorted(s for s in Field.SECOND.parse(parts[0]) if isinstance(s, int))
    five = " ".join(parts[1:])
    utc_start = start.astimezone(UTC)
    base = utc_start + _MINUTE if reverse else utc_start - _MINUTE
    last: dt.datetime | None = None
    for minute in CronSim(five, base.astimezone(zone), reverse=reverse):
        first = minute.astimezone(UTC)
        for s in (reversed(secs) if reverse else secs):
            at = first + dt.timedelta(seconds=s)
            if (at < utc_start if reverse else at > utc_start) and (
                    last is None or (at < last if reverse else at > last)):
                last = at
                yield at.astimezone(zone)


def slots_between(expr: str, zone: ZoneInfo, after: dt.datetime, until: dt.datetime,
                  limit: int = MAX_SLOTS_PER_TICK) -> list[dt.datetime]:
    """Instants (UTC) of ``expr`` in (after, until], at most ``limit``."""
    found: list[dt.datetime] = []
    for local in _instants(expr, zone, after):
        at = local.astimezone(UTC)
        if at > until or len(found) >= limit:
            break
        if at > after:
            found.append(at)
    return found


# Schedules added per tenant mostly share a few expressions: the next slot after
# a given instant is worked out once for all of them (cronsim takes ~20 us a call,
# which 10,000 schedules due on the same second would pay on every replica).
@functools.lru_cache(maxsize=16384)
def next_slot(expr: str, zone: ZoneInfo, after: dt.datetime) -> dt.datetime:
    """The first instant (UTC) of ``expr`` strictly after ``after``."""
    for local in _instants(expr, zone, after):
        at = local.astimezone(UTC)
        if at > after:
            return at
    raise ValueError(f"{expr!r} never fires")


def previous_slots(expr: str, zone: ZoneInfo, until: dt.datetime, n: int, *,
                   after: dt.datetime | None = None) -> list[dt.datetime]:
    """The last ``n`` instants (UTC) of ``expr`` at or before ``until`` (and after
    ``after``, if given), latest first."""
    found: list[dt.datetime] = []
    # cronsim's reverse walk starts strictly before its start: start a second later.
    start = (until + dt.timedelta(seconds=1)).replace(microsecond=0)
    for local in _instants(expr, zone, start, reverse=True):
        at = local.astimezone(UTC)
        if after is not None and at <= after:
            break
        if at <= until:
            found.append(at)
            if len(found) >= n:
                break
    return found


@dataclass
class Handler:
    """A function and how to run it: from ``@sched.job`` (schedules name it) or
    ``@sched.cron`` (its own schedule)."""

    fn: JobFn
    transactional: bool = False
    jitter: float = 0.0
    claim_ttl: float = 30.0
    keep: float = 30 * 86400.0


@dataclass
class Job:
    """One schedule as this replica runs it: its definition (from code or from
    ``pgcoord.schedules``), its handler's options, and what it has decided so far."""

    name: str
    expr: str
    tz: ZoneInfo
    fn: JobFn
    on_crash: str
    max_attempts: int
    catch_up: str
    deadline: float | None
    transactional: bool
    allow_overlap: bool
    jitter: float
    claim_ttl: float
    keep: float
    registered_at: dt.datetime | None = None  # slots count from here (schedules.since)
    timeout: float | None = None
    handler: str = ""
    args: Any = None
    version: int = 0
    paused: bool = False
    paused_at: dt.datetime | None = None
    resumed_at: dt.datetime | None = None
    #: Earlier pauses whose slots may not all be decided yet (``pgcoord.schedule_pauses``):
    #: (paused_at, resumed_at or None while paused).
    pauses: tuple[tuple[dt.datetime, dt.datetime | None], ...] = ()
    in_code: bool = True
    #: Every slot at or before this instant is decided (by some replica).
    after: dt.datetime | None = None
    #: The first slot after ``after``: nothing to do for this job before then.
    next_due: dt.datetime | None = None

    def slots_after(self, after: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
        """Scheduled instants in (after, until], in UTC, at most MAX_SLOTS_PER_TICK."""
        return slots_between(self.expr, self.tz, after, until)

    def next_after(self, after: dt.datetime) -> dt.datetime:
        return next_slot(self.expr, self.tz, after)

    def is_paused_slot(self, at: dt.datetime) -> bool:
        """Whether slot ``at`` falls in a pause of the schedule: its latest, or an
        earlier one of ``pauses``."""
        for start, end in self.pauses:
            if start < at and (end is None or at <= end):
                return True
        if self.paused and self.paused_at is None:
            return True  # paused by a hand-written UPDATE that gave no instant: all of it
        if self.paused_at is None or at <= self.paused_at:
            return False
        return self.paused or (self.resumed_at is not None and at <= self.resumed_at)

    def plan(self, due: list[dt.datetime], now: dt.datetime, *, final: bool,
             ) -> tuple[list[dt.datetime], dict[str, list[dt.datetime]]]:
        """Which of ``due`` to run and which to mark missed (by reason). ``final`` is
        False for a full batch that later slots follow: with catch_up="latest" none
        of it runs."""
        run: list[dt.datetime] = []
        missed: dict[str, list[dt.datetime]] = {}
        if not due:
            return run, missed
        grace = self.deadline
        if self.catch_up == "all":
            for at in due:
                if grace is not None and (now - at).total_seconds() > grace:
                    missed.setdefault("deadline", []).append(at)
                else:
                    run.append(at)
        elif self.catch_up == "latest":
            if not final:
                return run, {"catch_up=latest": list(due)}
            *older, latest = due
            if older:
                missed["catch_up=latest"] = older
            if grace is not None and (now - latest).total_seconds() > grace:
                missed.setdefault("deadline", []).append(latest)
            else:
                run.append(latest)
        else:  # none: only a slot that is due right now
            grace = 2.0 if grace is None else grace
            for at in due:
                if (now - at).total_seconds() > grace:
                    missed.setdefault("catch_up=none", []).append(at)
                else:
                    run.append(at)
        return run, missed

    def decide(self, now: dt.datetime) -> tuple[list[tuple[dt.datetime, str, str | None]], dt.datetime]:
        """The slots due in (after, now], each with what to do: ('run', None),
        ('missed', reason) or ('skipped', 'paused'); and the latest slot decided."""
        assert self.after is not None
        after = self.after
        todo: list[tuple[dt.datetime, str, str | None]] = []
        due_now = self.next_due
        if due_now is not None and after < due_now <= now < self.next_after(due_now):
            # The usual case, one slot due: no walk over the expression.
            if self.is_paused_slot(due_now):
                return [(due_now, "skipped", "paused")], due_now
            run, missed = self.plan([due_now], now, final=True)
            todo.extend((at, "run", None) for at in run)
            todo.extend((at, "missed", reason) for reason, slots in missed.items() for at in slots)
            return todo, due_now
        while True:
            due = self.slots_after(after, now)
            if not due:
                return todo, after
            final = (self.catch_up == "all" or len(due) < MAX_SLOTS_PER_TICK
                     or self.next_after(due[-1]) > now)
            normal = [at for at in due if not self.is_paused_slot(at)]
            todo.extend((at, "skipped", "paused") for at in due if self.is_paused_slot(at))
            run, missed = self.plan(normal, now, final=final)
            todo.extend((at, "run", None) for at in run)
            for reason, slots in missed.items():
                todo.extend((at, "missed", reason) for at in slots)
            after = due[-1]
            if final:
                return todo, after
