"""Slot arithmetic for schedules with their own zone (no database): both DST
transitions, pauses, and the plan of a tick."""

from __future__ import annotations

import datetime as dt
import itertools
from zoneinfo import ZoneInfo

import pytest

from pgcoord.scheduler.cron import (
    Job,
    check_expr,
    check_zone,
    next_slot,
    previous_slots,
    slots_between,
)

UTC = dt.UTC
PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def job(expr: str, tz: ZoneInfo = UTC, **kw: object) -> Job:
    defaults: dict[str, object] = dict(
        name="j", expr=expr, tz=tz, fn=None, on_crash="skip", max_attempts=3, catch_up="latest",
        deadline=None, transactional=False, allow_overlap=False, jitter=0.0, claim_ttl=30.0,
        keep=86400.0)
    defaults.update(kw)
    return Job(**defaults)  # type: ignore[arg-type]


def test_a_time_that_occurs_twice_on_the_fall_back_night_fires_once() -> None:
    # Paris leaves summer time on 2026-10-25 at 03:00 CEST (01:00 UTC): 02:30 happens twice.
    slots = slots_between("30 2 * * *", PARIS, at("2026-10-24T00:00:00"), at("2026-10-26T12:00:00"))
    assert slots == [at("2026-10-24T00:30:00"), at("2026-10-25T00:30:00"), at("2026-10-26T01:30:00")]


def test_a_time_in_the_spring_gap_fires_at_the_first_instant_after_it() -> None:
    # Paris enters summer time on 2026-03-29 at 02:00 CET: 02:30 does not exist that day.
    slots = slots_between("30 2 * * *", PARIS, at("2026-03-28T00:00:00"), at("2026-03-30T12:00:00"))
    assert slots == [at("2026-03-28T01:30:00"), at("2026-03-29T01:00:00"), at("2026-03-30T00:30:00")]


def test_each_schedule_keeps_its_own_zone() -> None:
    # The same expression, nine in the morning in two zones, on New York's spring-forward day.
    start = at("2026-03-08T00:00:00")
    assert next_slot("0 9 * * *", NEW_YORK, start) == at("2026-03-08T13:00:00")  # EDT, UTC-4
    assert next_slot("0 9 * * *", PARIS, start) == at("2026-03-08T08:00:00")     # CET, UTC+1
    assert next_slot("0 9 * * *", NEW_YORK, at("2026-03-07T00:00:00")) == at("2026-03-07T14:00:00")


def test_hourly_slots_across_both_transitions_are_never_doubled_or_lost() -> None:
    for start, end in (("2026-03-29T00:00:00", "2026-03-29T04:00:00"),
                       ("2026-10-25T00:00:00", "2026-10-25T04:00:00")):
        slots = slots_between("0 * * * *", PARIS, at(start), at(end))
        assert slots == sorted(set(slots))
        gaps = {b - a for a, b in itertools.pairwise(slots)}
        assert gaps == {dt.timedelta(hours=1)}


def test_previous_slots_are_latest_first_and_include_now() -> None:
    assert previous_slots("*/10 * * * *", UTC, at("2026-11-30T10:20:00"), 3) == [
        at("2026-11-30T10:20:00"), at("2026-11-30T10:10:00"), at("2026-11-30T10:00:00")]


def test_paused_slots_are_skipped_and_the_rest_follow_catch_up() -> None:
    spec = job("* * * * * *", paused=True, paused_at=at("2026-01-01T00:00:02.500000"))
    spec.after = at("2026-01-01T00:00:00")
    todo, last = spec.decide(at("2026-01-01T00:00:05"))
    assert last == at("2026-01-01T00:00:05")
    assert sorted(todo) == [
        (at("2026-01-01T00:00:01"), "missed", "catch_up=latest"),
        (at("2026-01-01T00:00:02"), "run", None),
        (at("2026-01-01T00:00:03"), "skipped", "paused"), (at("2026-01-01T00:00:04"), "skipped", "paused"),
        (at("2026-01-01T00:00:05"), "skipped", "paused"),
    ]
    # Resumed at 4.5 s: slots of the pause stay skipped, later ones run again.
    spec.paused, spec.resumed_at = False, at("2026-01-01T00:00:04.500000")
    spec.after = at("2026-01-01T00:00:02")
    todo, _ = spec.decide(at("2026-01-01T00:00:05"))
    assert sorted(todo) == [(at("2026-01-01T00:00:03"), "skipped", "paused"),
                            (at("2026-01-01T00:00:04"), "skipped", "paused"),
                            (at("2026-01-01T00:00:05"), "run", None)]


def test_bad_definitions_are_value_errors() -> None:
    with pytest.raises(ValueError, match="time zone"):
        check_zone("Mars/Olympus_Mons")
    with pytest.raises(ValueError, match="time zone"):
        check_zone(42)
    for expr in ("61 * * * *", "* * *", "every day"):
        with pytest.raises(ValueError):
            check_expr(expr, UTC)
    with pytest.raises(ValueError):
        check_expr(None, UTC)


def test_previous_slots_stop_at_after() -> None:
    zone = ZoneInfo("UTC")
    until = dt.datetime(2026, 1, 1, 0, 0, 10, tzinfo=dt.UTC)
    found = previous_slots("* * * * * *", zone, until, 100_000, after=until - dt.timedelta(seconds=3))
    assert found == [until - dt.timedelta(seconds=k) for k in range(3)]


@pytest.mark.parametrize("tz", [PARIS, NEW_YORK])
@pytest.mark.parametrize("expr", ["30 2 * * *", "0 * * * *", "*/20 * * * *", "30 1 * * *"])
def test_the_live_loop_decides_the_same_slots_as_a_backfill_across_both_transitions(
        tz: ZoneInfo, expr: str) -> None:
    """The loop wakes at each next_due and decides one slot at a time (next_slot,
    its shortcut); a backfill walks slots_between. Across both DST nights they agree."""
    for start, end in (("2026-03-07T00:00:00", "2026-03-09T12:00:00"),   # New York springs
                       ("2026-03-28T00:00:00", "2026-03-30T12:00:00"),   # Paris springs
                       ("2026-10-24T00:00:00", "2026-10-26T12:00:00"),   # Paris falls back
                       ("2026-10-31T00:00:00", "2026-11-02T12:00:00")):  # New York falls back
        spec = job(expr, tz, catch_up="none")
        spec.after = at(start)
        spec.next_due = spec.next_after(spec.after)
        ran: list[dt.datetime] = []
        while spec.next_due <= at(end):
            now = spec.next_due + dt.timedelta(milliseconds=5)  # the loop wakes at next_due
            todo, last = spec.decide(now)
            assert [act for _, act, _ in todo] == ["run"] * len(todo)
            ran += [slot for slot, _, _ in todo]
            spec.after = last
            spec.next_due = spec.next_after(last)
        assert ran == slots_between(expr, tz, at(start), at(end))
        assert len(ran) == len(set(ran))


BERLIN = ZoneInfo("Europe/Berlin")


@pytest.mark.parametrize("six, five", [("0 30 2 * * *", "30 2 * * *"), ("0 0 2 * * *", "0 2 * * *"),
                                       ("0 59 2 * * *", "59 2 * * *")])
def test_six_fields_follow_debian_across_both_transitions_like_five(six: str, five: str) -> None:
    # Berlin springs forward on 2026-03-29 at 02:00 CET and falls back on 2026-10-25 at 03:00 CEST.
    for start, end in (("2026-03-28T00:00:00", "2026-03-30T12:00:00"),
                       ("2026-10-24T00:00:00", "2026-10-26T12:00:00")):
        slots = slots_between(six, BERLIN, at(start), at(end))
        assert slots == slots_between(five, BERLIN, at(start), at(end))
        days = [s.astimezone(BERLIN).date() for s in slots]
        assert len(slots) >= 2 and days == sorted(set(days))  # once a night, whatever the night
        assert next_slot(six, BERLIN, at(start)) == slots[0]
        assert previous_slots(six, BERLIN, at(end), 9, after=at(start)) == slots[::-1]


def test_six_fields_with_seconds_keep_them_within_each_debian_minute() -> None:
    slots = slots_between("10,40 30 2 * * *", BERLIN, at("2026-03-28T12:00:00"), at("2026-03-29T12:00:00"))
    # 02:30 does not exist that night: the first minute after the gap, with its seconds.
    assert slots == [at("2026-03-29T01:00:10"), at("2026-03-29T01:00:40")]
    slots = slots_between("10,40 30 2 * * *", BERLIN, at("2026-10-24T12:00:00"), at("2026-10-25T12:00:00"))
    assert slots == [at("2026-10-25T00:30:10"), at("2026-10-25T00:30:40")]  # the first 02:30 only
    assert next_slot("10,40 30 2 * * *", BERLIN, at("2026-10-25T00:30:10")) == at("2026-10-25T00:30:40")
    # Fields that are not fixed keep counting elapsed time, as cronsim does for five.
    every = slots_between("*/30 * 2 * * *", BERLIN, at("2026-10-24T23:59:59"), at("2026-10-25T02:00:00"))
    assert len(every) == 2 * 120


def test_every_pause_of_the_history_skips_its_slots_and_catch_up_decides_the_rest() -> None:
    spec = job("* * * * * *", catch_up="all", paused_at=at("2026-01-01T00:00:06.500000"),
               resumed_at=at("2026-01-01T00:00:07.500000"),
               pauses=((at("2026-01-01T00:00:01.500000"), at("2026-01-01T00:00:03.500000")),))
    spec.after = at("2026-01-01T00:00:00")
    todo, _ = spec.decide(at("2026-01-01T00:00:08"))
    assert [(t[0].second, t[1]) for t in sorted(todo)] == [
        (1, "run"), (2, "skipped"), (3, "skipped"), (4, "run"), (5, "run"), (6, "run"),
        (7, "skipped"), (8, "run")]
    # Paused with no instant given (a hand-written UPDATE of paused alone): nothing runs.
    bare = job("* * * * * *", paused=True)
    bare.after = at("2026-01-01T00:00:00")
    assert {t[1] for t in bare.decide(at("2026-01-01T00:00:03"))[0]} == {"skipped"}
