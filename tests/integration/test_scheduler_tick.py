"""Nothing in a tick waits for one job (issue 22, part 1): a jittered decision, a
backlog that waits for its run, and the housekeeping of many schedules stay off
the loop, so every other schedule's slots start on time."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from pgcoord.scheduler import Scheduler, Slot
from pgcoord.testing import wait_until

from .conftest import sql, unique

UTC = dt.UTC


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    yield p
    await p.close()


async def _noop(slot: Slot) -> None:
    pass


def slot_rows(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, state, reason, extract(epoch from started_at - slot_at)"
                    " from pgcoord.job_slots where job = %s and not manual order by slot_at", job)


def db_now(dsn: str) -> dt.datetime:
    value = sql(dsn, "select clock_timestamp()")[0][0]
    assert isinstance(value, dt.datetime)
    return value


async def test_a_jittered_job_does_not_hold_up_a_per_second_job_beside_it(
        dsn: str, pool: asyncpg.Pool) -> None:
    jittered, steady = unique("jitter-4"), unique("steady")
    s = Scheduler(pool)
    s.cron(jittered, "* * * * * *", jitter=4)(_noop)
    s.cron(steady, "* * * * * *", catch_up="none")(_noop)
    task = asyncio.create_task(s.run())
    await asyncio.sleep(10)
    await s.stop()
    await task
    rows = slot_rows(dsn, steady)
    # Every second of the steady job ran, each soon after it came due: nothing missed
    # or skipped because the loop was asleep in another job's jitter.
    assert len(rows) >= 6, rows
    assert [r for r in rows if r[1] != "succeeded"] == []
    seconds = [int(r[0].timestamp()) for r in rows]
    assert seconds == list(range(seconds[0], seconds[-1] + 1))
    assert max(float(r[3]) for r in rows) < 1.5, rows
    # The jittered job ran too, each start within its jitter (and a tick) of its slot,
    # and no slot of it has two rows (the primary key would refuse a second claim,
    # but a second decision would show as an error in the log, not here: see below).
    ran = [r for r in slot_rows(dsn, jittered) if r[1] == "succeeded"]
    assert ran and all(0 <= float(r[3]) < 4 + 1.5 for r in ran), ran


async def test_a_schedule_added_during_a_long_jitter_runs_within_a_second_or_two(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("added"), unique("added:one")
    s = Scheduler(pool)
    s.cron(unique("jitter-8"), "* * * * * *", jitter=8)(_noop)
    s.job(handler)(_noop)
    task = asyncio.create_task(s.run())
    try:
        await asyncio.sleep(3)  # the loop is now (before the fix) inside an 8 s jitter
        added = db_now(dsn)
        await s.add(name, "* * * * * *", handler=handler)
        await wait_until(lambda: [r for r in slot_rows(dsn, name) if r[1] == "succeeded"], within=12)
    finally:
        await s.stop()
        await task
    rows = slot_rows(dsn, name)
    assert rows, "the added schedule never ran"
    # Its first slot ran (none recorded missed while the loop slept in a jitter)...
    assert rows[0][1] == "succeeded", rows
    started = rows[0][0] + dt.timedelta(seconds=float(rows[0][3]))
    # ...soon: a change reaches the loop within a tick (1 s), and the first slot is at
    # most a second away, so 3 s is generous; inside an 8 s jitter it was up to 8 s.
    assert (started - added).total_seconds() < 3.0, (added, rows[0])


async def test_a_jittered_decision_is_stopped_by_stop_and_claims_nothing_after(
        dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("jitter-stop")
    s = Scheduler(pool)
    s.cron(job, "* * * * * *", jitter=30)(_noop)
    task = asyncio.create_task(s.run())
    await asyncio.sleep(2.5)
    started = time.monotonic()
    await s.stop()
    await asyncio.wait_for(task, 10)
    # stop() does not wait out a 30 s jitter, and no decision is left behind.
    assert time.monotonic() - started < 5
    stopped = db_now(dsn)
    await asyncio.sleep(1.5)
    assert [r for r in slot_rows(dsn, job) if r[0] > stopped] == []
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("pgcoord-scheduler-jitter")]


def committed(dsn: str) -> int:
    """Transactions committed in the test database so far (as the statistics have
    them: a backend flushes its counts at the latest when it exits)."""
    value = sql(dsn, "select xact_commit from pg_stat_database where datname = current_database()")
    return int(value[0][0])  # type: ignore[call-overload]


async def test_a_backlog_waiting_for_its_run_does_not_spin_the_loop(dsn: str) -> None:
    job = unique("slow-all")
    spans: list[tuple[float, float]] = []

    async def slow(slot: Slot) -> None:
        began = time.monotonic()
        await asyncio.sleep(1.5)
        spans.append((began, time.monotonic()))

    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    before = committed(dsn)
    s = Scheduler(pool)
    s.cron(job, "* * * * * *", catch_up="all")(slow)
    task = asyncio.create_task(s.run())
    await asyncio.sleep(8)
    await s.stop()
    await task
    await pool.close()  # the backends exit, and so flush their statistics
    await asyncio.sleep(1.0)
    used = committed(dsn) - before
    # Each run costs a claim, a record and a heartbeat or two, and the loop a tick a
    # second: some tens of transactions in 8 s. Spinning on the waiting slot, it
    # was thousands (~12,700).
    assert used < 600, used
    # The backlog still goes on one run after another, each as the one before ends.
    assert len(spans) >= 4, spans
    ordered = sorted(spans)
    assert all(b[0] >= a[1] - 0.01 for a, b in itertools.pairwise(ordered))
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(ordered)]
    assert max(gaps) < 0.8, gaps


@pytest.mark.parametrize("chore", ["retention", "recovery"])
async def test_a_housekeeping_pass_held_up_does_not_hold_up_the_tick(
        dsn: str, pool: asyncpg.Pool, chore: str) -> None:
    """A row lock that the chore's statement waits on (a pass over 10,000 schedules
    takes as long): the per-second job beside it still runs every second."""
    steady = unique("steady")
    s = Scheduler(pool)
    s.cron(steady, "* * * * * *", catch_up="none", keep=1.0)(_noop)
    if chore == "retention":  # an old finished row (not the latest) that the pass deletes
        sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, attempt, finished_at)"
                 " values (%s, '2000-01-01', 'succeeded', 1, now() - interval '1 day'),"
                 " (%s, '2000-01-02', 'succeeded', 1, now() - interval '1 day')", steady, steady)
        locked = dt.datetime(2000, 1, 1, tzinfo=UTC)
        held = steady
    else:  # another job's claim that expired, which the pass records abandoned
        held = unique("yearly")
        s.cron(held, "0 0 1 1 *")(_noop)
        sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner, started_at,"
                 " claim_expires_at) values (%s, '2000-01-01', 'running', 1, 'gone', now(),"
                 " now() - interval '1 s')", held)
        locked = dt.datetime(2000, 1, 1, tzinfo=UTC)
    blocker = await asyncpg.connect(dsn)
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("select 1 from pgcoord.job_slots where job = $1 and slot_at = $2"
                              " for update", held, locked)
        task = asyncio.create_task(s.run())
        await asyncio.sleep(6)
        began = time.monotonic()
        await s.stop()
        await task
        assert time.monotonic() - began < 10  # the chore waiting on the lock is stopped too
        await tx.rollback()
    finally:
        await blocker.close()
    rows = [r for r in slot_rows(dsn, steady) if r[0].year > 2000]
    assert len(rows) >= 3, rows
    assert [r for r in rows if r[1] != "succeeded"] == []
    assert max(float(r[3]) for r in rows) < 1.5, rows
