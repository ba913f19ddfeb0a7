"""Scheduler (docs/scheduler.md) in one process: slots, catch-up, overlap, crashes, DST, retention."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import psycopg
import pytest

import pgcoord
from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique

UTC = dt.UTC




@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    yield p
    await p.close()


async def run_for(seconds: float, *schedulers: Scheduler) -> None:
    tasks = [asyncio.create_task(s.run()) for s in schedulers]
    await asyncio.sleep(seconds)
    for s in schedulers:
        await s.stop()
    await asyncio.gather(*tasks)


def slot_rows(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, state, reason, attempt from pgcoord.job_slots"
                    " where job = %s and not manual order by slot_at", job)


def assert_contiguous(rows: list[tuple[Any, ...]]) -> None:
    seconds = [int(r[0].timestamp()) for r in rows]
    assert seconds == list(range(seconds[0], seconds[-1] + 1))


def register_in_the_past(dsn: str, job: str, expr: str, seconds_ago: float) -> None:
    """As if a replica registered the job and then every replica was down."""
    sql(dsn, "insert into pgcoord.jobs (job, schedule, tz, registered_at)"
             " values (%s, %s, 'UTC', clock_timestamp() - %s * interval '1 second')",
        job, expr, seconds_ago)


async def test_three_replicas_run_each_slot_exactly_once(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("every-second")
    ran: list[tuple[dt.datetime, str]] = []
    replicas = []
    for i in range(3):
        s = Scheduler(pool, runner=f"replica-{i}")

        async def work(slot: Slot, who: str = f"replica-{i}") -> None:
            ran.append((slot.at, who))

        s.cron(job, "* * * * * *")(work)
        replicas.append(s)
    await run_for(4.2, *replicas)
    rows = slot_rows(dsn, job)
    assert len(rows) >= 3
    assert_contiguous(rows)
    assert {r[1] for r in rows} == {"succeeded"}
    ats = [at for at, _ in ran]
    assert sorted(ats) == sorted(set(ats)) == [r[0] for r in rows]
    assert all(r[0].tzinfo is not None for r in rows)


@pytest.mark.parametrize("policy", ["latest", "none", "all"])
async def test_catch_up_after_downtime(dsn: str, pool: asyncpg.Pool, policy: str) -> None:
    job = unique(f"catch-up-{policy}")
    register_in_the_past(dsn, job, "* * * * * *", 6)
    ran: list[dt.datetime] = []
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", catch_up=policy, deadline=0.9 if policy == "none" else None)
    async def work(slot: Slot) -> None:
        ran.append(slot.at)

    await run_for(1.6, s)
    rows = slot_rows(dsn, job)
    assert_contiguous(rows)
    assert len(rows) >= 6
    missed = [r for r in rows if r[1] == "missed"]
    succeeded = [r for r in rows if r[1] == "succeeded"]
    assert len(missed) + len(succeeded) == len(rows)
    if policy == "all":
        assert missed == []
    elif policy == "latest":
        assert len(missed) >= 4 and {r[2] for r in missed} == {"catch_up=latest"}
        # the backlog ran once, as its latest slot; then slots ran on time
        assert len(succeeded) <= 3
    else:
        assert len(missed) >= 5 and {r[2] for r in missed} == {"catch_up=none"}
    assert sorted(ran) == [r[0] for r in succeeded]


async def test_a_deadline_marks_old_slots_missed(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("deadline")
    register_in_the_past(dsn, job, "* * * * * *", 5)
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", catch_up="all", deadline=2.5)
    async def work(slot: Slot) -> None:
        pass

    await run_for(1.2, s)
    rows = slot_rows(dsn, job)
    assert_contiguous(rows)
    assert {r[2] for r in rows if r[1] == "missed"} == {"deadline"}
    assert 1 <= len([r for r in rows if r[1] == "missed"]) <= 4


@pytest.mark.parametrize("allow_overlap", [False, True])
async def test_a_slot_due_while_the_previous_run_goes_on(
    dsn: str, pool: asyncpg.Pool, allow_overlap: bool,
) -> None:
    job = unique("slow")
    running = 0
    most = 0
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", allow_overlap=allow_overlap)
    async def slow(slot: Slot) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(2.2)
        running -= 1

    await run_for(4.5, s)
    rows = slot_rows(dsn, job)
    if allow_overlap:
        assert most >= 2 and not [r for r in rows if r[1] == "skipped"]
    else:
        assert most == 1
        skipped = [r for r in rows if r[1] == "skipped"]
        assert skipped and {r[2] for r in skipped} == {"overlap"}


@pytest.mark.parametrize("jitter", [0.0, 0.2])
async def test_a_run_that_ended_is_not_overlapped_by_the_next_slot_while_its_end_is_recorded(
    dsn: str, pool: asyncpg.Pool, jitter: float,
) -> None:
    """A run's body ends at once, but its record is held up past the next slot (here a
    row lock on its slot; in CI, a loaded machine). The next slot used to be skipped
    ('overlap') as if the run were still going, since the database still said so; it
    is decided once the record is in, and runs (also after a jitter's wait)."""
    job = unique("slow-record")
    held: list[dt.datetime] = []
    release: list[asyncio.Task[None]] = []
    s = Scheduler(pool)

    async def hold_row(conn: asyncpg.Connection, tx: Any) -> None:
        try:
            await asyncio.sleep(1.6)
        finally:
            await tx.rollback()
            await conn.close()

    @s.cron(job, "* * * * * *", jitter=jitter)
    async def work(slot: Slot) -> None:
        if not held:
            held.append(slot.at)
            conn = await asyncpg.connect(dsn)
            tx = conn.transaction()
            await tx.start()
            await conn.execute("select 1 from pgcoord.job_slots where job = $1 and slot_at = $2"
                               " for update", job, slot.at)
            release.append(asyncio.create_task(hold_row(conn, tx)))

    await run_for(4.5, s)
    await asyncio.gather(*release)
    rows = slot_rows(dsn, job)
    assert held and rows[0][0] == held[0]
    assert_contiguous(rows)
    assert len(rows) >= 3, rows
    assert {r[1] for r in rows} == {"succeeded"}, rows


def plant_crashed_claim(dsn: str, job: str, expr: str) -> dt.datetime:
    """A slot claimed by a runner that then died: its claim expires at once."""
    register_in_the_past(dsn, job, expr, 60)
    [(slot,)] = sql(dsn, "select date_trunc('second', clock_timestamp()) - interval '3 seconds'")
    sql(dsn, "select * from pgcoord.job_claim(%s, %s, 'dead-runner', 1, 'run', false)", job, slot)
    sql(dsn, "select pgcoord.job_mark_missed(%s, array(select generate_series("
             "%s - interval '57 seconds', %s - interval '1 second', interval '1 second')), 'test')",
        job, slot, slot)
    return slot


async def test_on_crash_skip_records_a_crashed_slot_abandoned(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("crash-skip")
    slot = plant_crashed_claim(dsn, job, "0 0 1 1 *")  # never due during the test
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.cron(job, "0 0 1 1 *", on_crash="skip")
    async def work(slot_: Slot) -> None:
        ran.append(slot_)

    await run_for(1.0, s)
    assert ran == []
    assert sql(dsn, "select state, reason from pgcoord.job_slots where job = %s and slot_at = %s",
               job, slot) == [("abandoned", "runner lost")]


async def test_on_crash_retry_runs_the_slot_again_as_a_new_attempt(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    job = unique("crash-retry")
    slot = plant_crashed_claim(dsn, job, "0 0 1 1 *")
    s = Scheduler(pool, runner="rescuer")
    ran: list[Slot] = []

    @s.cron(job, "0 0 1 1 *", on_crash="retry", max_attempts=3)
    async def work(slot_: Slot) -> None:
        ran.append(slot_)

    await run_for(1.0, s)
    assert [(r.at, r.attempt) for r in ran] == [(slot, 2)]
    assert sql(dsn, "select state, attempt, runner from pgcoord.job_slots"
                    " where job = %s and slot_at = %s", job, slot) == [("succeeded", 2, "rescuer")]


def test_a_superseded_runner_cannot_record_a_result(dsn: str) -> None:
    job = unique("superseded")
    slot = dt.datetime(2030, 1, 1, tzinfo=UTC)
    sql(dsn, "select * from pgcoord.job_claim(%s, %s, 'first', 1, 'run', false)", job, slot)
    import time
    time.sleep(0.05)
    [(_, attempt)] = sql(dsn, "select * from pgcoord.job_recover(%s, 'second', 60000, true, 3)", job)
    assert attempt == 2
    assert sql(dsn, "select pgcoord.job_finish(%s, %s, 'first', 1, 'succeeded', null, null)",
               job, slot) == [(False,)]
    assert sql(dsn, "select pgcoord.job_heartbeat(%s, %s, 'first', 1, 60000)", job, slot) == [(False,)]
    assert sql(dsn, "select pgcoord.job_finish(%s, %s, 'second', 2, 'succeeded', null, null)",
               job, slot) == [(True,)]


async def test_transactional_writes_commit_with_the_slot_or_not_at_all(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    sql(dsn, "create table if not exists tx_effects (job text, slot_at timestamptz)")
    job = unique("transactional")
    fail = {"now": False}
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", transactional=True)
    async def work(slot: Slot) -> None:
        assert slot.conn is not None
        await slot.conn.execute("insert into tx_effects values ($1, $2)", slot.job, slot.at)
        if fail["now"]:
            raise RuntimeError("after the write")

    task = asyncio.create_task(s.run())
    await asyncio.sleep(2.2)
    fail["now"] = True
    await asyncio.sleep(2.0)
    await s.stop()
    await task
    rows = slot_rows(dsn, job)
    ok = {r[0] for r in rows if r[1] == "succeeded"}
    failed = {r[0] for r in rows if r[1] == "failed"}
    assert ok and failed
    effects = {r[1] for r in sql(dsn, "select job, slot_at from tx_effects where job = %s", job)}
    assert effects == ok


async def test_trigger_runs_now_without_using_a_scheduled_slot(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("manual")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.cron(job, "0 3 * * *", tz="Europe/Berlin")
    async def nightly(slot: Slot) -> None:
        ran.append(slot)

    slot = await s.trigger(job)
    assert ran and ran[0].manual and ran[0].at == slot.at
    assert sql(dsn, "select state, manual from pgcoord.job_slots where job = %s", job) == [
        ("succeeded", True)]
    nxt = s.next_runs(job, 1)[0]
    assert nxt.astimezone(ZoneInfo("Europe/Berlin")).hour == 3 and nxt > slot.at


@pytest.mark.parametrize(("tz", "spring", "fall", "fall_time"), [
    ("America/New_York", dt.date(2026, 3, 8), dt.date(2026, 11, 1), "30 1 * * *"),
    ("Europe/Berlin", dt.date(2026, 3, 29), dt.date(2026, 10, 25), "30 2 * * *"),
    ("Australia/Sydney", dt.date(2026, 10, 4), dt.date(2026, 4, 5), "30 2 * * *"),
])
async def test_dst_follows_debian_cron(pool: asyncpg.Pool, tz: str, spring: dt.date,
                                       fall: dt.date, fall_time: str) -> None:
    zone = ZoneInfo(tz)
    s = Scheduler(pool)
    s.cron("gap", "30 2 * * *", tz=tz)(_noop)
    s.cron("repeat", fall_time, tz=tz)(_noop)
    s.cron("quarter", "*/15 * * * *", tz=tz)(_noop)

    def runs(job: str, day: dt.date, n: int) -> list[dt.datetime]:
        start = dt.datetime.combine(day - dt.timedelta(days=1), dt.time(12), zone)
        return [r.astimezone(zone) for r in s.next_runs(job, n, after=start)]

    # Spring forward: 02:30 does not exist that night; it runs at the first instant after the gap.
    gap = runs("gap", spring, 2)
    assert (gap[0].date(), gap[0].hour, gap[0].minute) == (spring, 3, 0)
    assert (gap[1].hour, gap[1].minute) == (2, 30)
    # Fall back: the repeated hour's fixed time runs once, not twice.
    repeat = runs("repeat", fall, 3)
    assert [r.date() for r in repeat] == [fall, fall + dt.timedelta(days=1),
                                          fall + dt.timedelta(days=2)]
    # Every-15-minutes runs on real elapsed time, so the repeated hour has 4 more runs.
    start = dt.datetime.combine(fall, dt.time(0), zone)
    day_after = dt.datetime.combine(fall + dt.timedelta(days=1), dt.time(0), zone)
    quarters = [r for r in s.next_runs("quarter", 200, after=start) if r < day_after]
    assert len(quarters) == 25 * 4 - 1  # a 25-hour day, exclusive of its first instant
    assert all(isinstance(r, dt.datetime) and r.tzinfo is not None for r in quarters)


async def _noop(slot: Slot) -> None:
    pass


async def test_retention_prunes_old_rows_in_batches_and_keeps_what_due_ness_needs(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    job = unique("retention")
    sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, finished_at)"
             " select %s, t, 'succeeded', t from generate_series("
             " now() - interval '40 days', now() - interval '39 days', interval '1 minute') t", job)
    latest = sql(dsn, "select max(slot_at) from pgcoord.job_slots where job = %s", job)[0][0]
    s = Scheduler(pool)
    s.cron(job, "0 0 1 1 *")(_noop)
    deleted = await s.prune(job, batch=250)
    assert deleted == 1440  # all but the latest scheduled slot, 250 at a time
    assert sql(dsn, "select slot_at from pgcoord.job_slots where job = %s", job) == [(latest,)]


async def test_holders_shows_a_running_job(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("visible")
    seen: list[tuple[Any, ...]] = []
    s = Scheduler(pool, runner="replica-x")

    @s.cron(job, "0 0 1 1 *")
    async def work(slot: Slot) -> None:
        seen.extend(sql(dsn, "select kind, holder, fence from pgcoord.holders"
                             " where kind = 'job' and name like %s", job + " @ %"))

    await s.trigger(job)
    assert seen == [("job", "replica-x", 1)]


async def test_jitter_delays_the_start_within_bounds(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("jitter")
    s = Scheduler(pool)
    s.cron(job, "* * * * * *", jitter=0.3)(_noop)
    await run_for(3.2, s)
    lags = [r[0] for r in sql(dsn, "select extract(epoch from started_at - slot_at)"
                                   " from pgcoord.job_slots where job = %s", job)]
    assert lags and all(0 <= float(lag) < 1.0 for lag in lags)


async def test_bad_input_raises_value_error_at_decoration(dsn: str, pool: asyncpg.Pool) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError, match="async"):
            Scheduler(conn)
        s = Scheduler(pool)
        for expr in ("61 * * * *", "* * *", "* * * * * * *", "every day"):
            with pytest.raises(ValueError):
                s.cron("bad", expr)
        with pytest.raises(ValueError, match="time zone"):
            s.cron("bad", "* * * * *", tz="Mars/Olympus_Mons")
        with pytest.raises(ValueError):
            s.cron("bad", "* * * * *", on_crash="sometimes")
        with pytest.raises(ValueError):
            s.cron("bad", "* * * * *", catch_up="most")
        with pytest.raises(ValueError):
            s.cron("bad", "* * * * *", max_attempts=0)
        s.cron("good", "*/15 * * * * *")(_noop)
        with pytest.raises(ValueError, match="already"):
            s.cron("good", "* * * * *")
    with pytest.raises(pgcoord.UnsupportedConnection):
        Scheduler(object())
