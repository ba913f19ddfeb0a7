"""A tick's decisions over many schedules (pgcoord.scheduler.plan), on a clock of
the test's own: no database, no event loop."""

from __future__ import annotations

import datetime as dt

import pytest

from pgcoord.scheduler import plan
from pgcoord.scheduler.cron import Job

UTC = dt.UTC
NOON = dt.datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def job(name: str, expr: str = "* * * * *", **kw: object) -> Job:
    defaults: dict[str, object] = dict(
        name=name, expr=expr, tz=UTC, fn=None, on_crash="skip", max_attempts=3, catch_up="latest",
        deadline=None, transactional=False, allow_overlap=False, jitter=0.0, claim_ttl=30.0,
        keep=86400.0)
    defaults.update(kw)
    return Job(**defaults)  # type: ignore[arg-type]


def since(spec: Job, after: dt.datetime) -> Job:
    spec.after = after
    spec.next_due = spec.next_after(after)
    return spec


def minutes(n: float) -> dt.timedelta:
    return dt.timedelta(minutes=n)


def test_due_splits_the_jittered_from_the_rest_and_leaves_what_is_not_due() -> None:
    plain = since(job("plain"), NOON - minutes(1))
    jittered = since(job("jittered", jitter=2.0), NOON - minutes(1))
    later = since(job("later"), NOON)
    never = job("never")  # not loaded yet: no next_due
    assert plan.due([plain, jittered, later, never], NOON) == ([plain], [jittered])


def test_a_backlog_of_catch_up_all_waits_after_its_first_run() -> None:
    spec = since(job("all", catch_up="all"), NOON - minutes(3))
    groups, decided = plan.entries([spec], NOON)
    assert [(e[1], e[3], e[5]) for e in groups[0]] == [(NOON - minutes(2), "run", "wait")]
    assert decided == {"all": NOON - minutes(1) - plan.TINY}


def test_catch_up_latest_runs_the_latest_and_misses_the_rest() -> None:
    spec = since(job("latest", claim_ttl=2.5), NOON - minutes(3))
    groups, decided = plan.entries([spec], NOON)
    assert sorted((e[1], e[3], e[4]) for e in groups[0]) == [
        (NOON - minutes(2), "missed", "catch_up=latest"),
        (NOON - minutes(1), "missed", "catch_up=latest"),
        (NOON, "run", None)]
    assert {(e[5], e[6]) for e in groups[0]} == {("skip", 2500)}
    assert decided == {"latest": NOON}


def test_batches_never_split_a_schedule_and_keep_every_entry() -> None:
    specs = [since(job(f"j{i}", catch_up="none"), NOON - minutes(1) - dt.timedelta(seconds=1))
             for i in range(plan.DECIDE_BATCH + 10)]
    groups, _ = plan.entries(specs, NOON)
    groups.append([("big", NOON - minutes(k), 0, "missed", "x", "skip", 1) for k in range(300)])
    parts = plan.batches(groups)
    # 510 schedules of 2 entries: 250 a batch, and the last 10 with the 300 of "big".
    assert sorted(len(part) for part in parts) == [320, 500, 500]
    assert sorted(e for part in parts for e in part) == sorted(e for g in groups for e in g)
    where: dict[str, int] = {}
    for index, part in enumerate(parts):
        for entry in part:
            assert where.setdefault(entry[0], index) == index


def test_settle_moves_each_schedule_on_or_reports_it_stale() -> None:
    ran, waits, stale = (since(job(n), NOON - minutes(1)) for n in ("ran", "waits", "stale"))
    decided = {"ran": NOON, "waits": NOON, "stale": NOON}
    assert plan.settle([ran, waits], decided, {"waits": NOON - minutes(1)}, set()) is False
    assert (ran.after, ran.next_due) == (NOON, NOON + minutes(1))
    assert (waits.after, waits.next_due) == (NOON - minutes(1) - plan.TINY, NOON - minutes(1))
    assert plan.settle([stale], decided, {}, {"stale"}) is True
    assert stale.after == NOON - minutes(1)


def test_the_loop_wakes_at_the_next_slot_or_after_max_sleep() -> None:
    soon = since(job("soon"), NOON)
    assert plan.next_wake([soon], NOON, 120.0) == (NOON + minutes(1)).timestamp()
    assert plan.next_wake([soon], NOON, 5.0) == NOON.timestamp() + 5.0
    assert plan.next_wake([], NOON, 5.0) == NOON.timestamp() + 5.0


def test_a_resumes_owed_run_runs_only_if_a_slot_fell_in_the_pause() -> None:
    hourly = job("hourly", "0 * * * *")
    owed = [(hourly, NOON, None, None),                                 # a trigger
            (hourly, NOON, NOON - minutes(50), NOON - minutes(10)),     # no hour in the pause
            (hourly, NOON, NOON - minutes(70), NOON - minutes(10))]     # 11:00 in it
    assert plan.owed_runs(owed) == [True, False, True]


def test_upcoming_and_backfill_slots() -> None:
    hourly = job("hourly", "0 * * * *")
    assert plan.upcoming(hourly, NOON, 2) == [NOON + minutes(60), NOON + minutes(120)]
    assert plan.backfill_slots(hourly, NOON - minutes(120), NOON, NOON) == [
        NOON - minutes(120), NOON - minutes(60), NOON]
    with pytest.raises(ValueError, match="future"):
        plan.backfill_slots(hourly, NOON, NOON + minutes(1), NOON)
    with pytest.raises(ValueError, match="split the range"):
        plan.backfill_slots(job("s", "* * * * * *"), NOON - dt.timedelta(days=1), NOON, NOON)
    with pytest.raises(ValueError, match="aware"):
        plan.check_range(NOON.replace(tzinfo=None), NOON)
    with pytest.raises(ValueError, match="after its end"):
        plan.check_range(NOON, NOON - minutes(1))


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    for failures, base in ((1, plan.BACKOFF_FIRST), (2, 2 * plan.BACKOFF_FIRST), (50, plan.BACKOFF_MAX)):
        assert base / 2 <= plan.backoff(failures) <= base
