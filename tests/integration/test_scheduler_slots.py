"""Each slot decided once, by the right rule, and never run beside itself (issue 22, part 2):
the history of pauses, a changed expression in code, owed runs and overlap, unique keys,
backfills over a pause, triggers of a job that must not overlap, a schedule removed and
added again."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import pytest

from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique

UTC = dt.UTC


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=8)
    yield p
    await p.close()


def rows(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, state, reason, manual from pgcoord.job_slots"
                    " where job = %s order by slot_at", job)


def db_now(dsn: str) -> dt.datetime:
    value = sql(dsn, "select clock_timestamp()")[0][0]
    assert isinstance(value, dt.datetime)
    return value


async def wait_for(check: Any, within: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


class Peak:
    """How many runs of a body were going at once, at most."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.now = 0
        self.peak = 0
        self.ran: list[Slot] = []

    async def body(self, slot: Slot) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.now -= 1
            self.ran.append(slot)


async def _noop(slot: Slot) -> None:
    pass


async def _run_for(s: Scheduler, seconds: float) -> None:
    task = asyncio.create_task(s.run())
    try:
        await asyncio.sleep(seconds)
    finally:
        await s.stop()
        await task


# -- the history of pauses ---------------------------------------------------------------


@pytest.mark.parametrize("catch_up", ["latest", "all"])
async def test_slots_of_every_pause_are_skipped_even_when_no_replica_ran_during_them(
        dsn: str, pool: asyncpg.Pool, catch_up: str) -> None:
    handler, name = unique("h"), unique(f"pauses-{catch_up}")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    await s.add(name, "* * * * * *", handler=handler, catch_up=catch_up, allow_overlap=True)
    pauses = []
    for length in (3.2, 1.2):  # no replica runs: nothing records the pauses' slots as they come
        await asyncio.sleep(0.3)
        before = db_now(dsn)
        await s.pause(name)
        paused = db_now(dsn)
        await asyncio.sleep(length)
        resuming = db_now(dsn)
        await s.resume(name)
        pauses.append((before, paused, resuming, db_now(dsn)))
    await _run_for(s, 2.0)
    got = {r[0]: r for r in rows(dsn, name)}
    for _, paused, resuming, _ in pauses:
        inside = [at for at in got if paused < at <= resuming]
        assert len(inside) >= 1
        assert {(got[at][1], got[at][2]) for at in inside} == {("skipped", "paused")}, (
            paused, resuming, [got[at] for at in inside])
    assert not [r for r in ran for _, paused, resuming, _ in pauses if paused < r.at <= resuming]


def test_pause_history_is_bounded_by_what_is_decided(dsn: str) -> None:
    """A pause whose slots are all decided is forgotten at the next pause: the history
    of a schedule paused every day does not grow for ever."""
    name = unique("bounded")
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '* * * * *', 'UTC', '{}', '{}')", name)
    for _ in range(3):
        sql(dsn, "select pgcoord.schedule_pause(%s)", name)
        sql(dsn, "select pgcoord.schedule_resume(%s)", name)
    assert len(sql(dsn, "select 1 from pgcoord.schedule_pauses where name = %s", name)) == 3
    # A replica decided a slot after all three: they are no longer needed.
    sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, reason, finished_at)"
             " values (%s, clock_timestamp(), 'succeeded', null, clock_timestamp())", name)
    sql(dsn, "select pgcoord.schedule_pause(%s)", name)
    assert len(sql(dsn, "select 1 from pgcoord.schedule_pauses where name = %s", name)) == 1
    sql(dsn, "select pgcoord.schedule_remove(%s)", name)
    assert not sql(dsn, "select 1 from pgcoord.schedule_pauses where name = %s", name)


# -- a changed expression in code ----------------------------------------------------------


async def test_a_changed_expression_in_code_counts_its_slots_from_the_change(
        dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("recoded")
    old = Scheduler(pool)
    old.cron(name, "0 0 1 1 *", catch_up="all", allow_overlap=True)(_noop)
    await _run_for(old, 0.5)
    await asyncio.sleep(3.2)  # the new code is deployed a while later
    new = Scheduler(pool)
    peak = Peak(0.5)
    new.cron(name, "* * * * * *", catch_up="all", allow_overlap=True)(peak.body)
    changed = db_now(dsn)
    await _run_for(new, 2.5)
    since = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    assert since >= changed
    # The new expression's slots count from the change: none of before it ran, so
    # no burst of runs at once at start.
    assert [r for r in rows(dsn, name) if r[0] < changed] == []
    assert peak.peak <= 2 and peak.ran


# -- owed runs obey overlap ------------------------------------------------------------------


async def test_update_of_a_catch_up_all_backlog_runs_it_one_slot_at_a_time(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("backlog")
    s = Scheduler(pool)
    peak = Peak(0.4)
    s.job(handler)(peak.body)
    await s.add(name, "* * * * * *", handler=handler, catch_up="all")
    await asyncio.sleep(3.3)  # no replica runs: a backlog of the old expression
    await s.update(name, expr="0 0 1 1 *")
    owed = sql(dsn, "select count(*) from pgcoord.schedule_owed where name = %s", name)[0][0]
    assert isinstance(owed, int) and owed >= 3
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(peak.ran) >= owed, within=30)
    finally:
        await s.stop()
        await task
    assert peak.peak == 1
    assert len({r.at for r in peak.ran}) == len(peak.ran) == owed
    assert {r[1] for r in rows(dsn, name) if r[1] != "missed"} == {"succeeded"}


async def test_triggers_of_a_job_that_must_not_overlap_run_one_after_another(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("triggered")
    s = Scheduler(pool)
    peak = Peak(0.8)
    s.job(handler)(peak.body)
    await s.add(name, "0 0 1 1 *", handler=handler)
    task = asyncio.create_task(s.run())
    try:
        for _ in range(2):  # from SQL (or the CLI): owed runs, taken by the loop
            sql(dsn, "select pgcoord.schedule_trigger(%s)", name)
        await wait_for(lambda: peak.now == 1)
        direct = await s.trigger(name)  # while one runs: waits for it, then runs
        await wait_for(lambda: len(peak.ran) >= 3)
    finally:
        await s.stop()
        await task
    assert peak.peak == 1
    assert direct.manual and len({r.key for r in peak.ran}) == 3
    assert [r[1] for r in rows(dsn, name)] == ["succeeded"] * 3


async def test_resumes_of_several_pauses_owe_runs_that_do_not_overlap(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("resumes")
    s = Scheduler(pool)
    peak = Peak(0.8)
    s.job(handler)(peak.body)
    await s.add(name, "* * * * * *", handler=handler, paused=True)
    for _ in range(2):
        await asyncio.sleep(1.2)
        await s.resume(name, catch_up="latest")
        await s.pause(name)
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(peak.ran) >= 2)
        await asyncio.sleep(0.5)
    finally:
        await s.stop()
        await task
    assert peak.peak == 1 and len(peak.ran) == 2
    assert all(r.manual for r in peak.ran)
    assert {(r[1], r[2]) for r in rows(dsn, name) if not r[3]} <= {("skipped", "paused")}


# -- keys -------------------------------------------------------------------------------------


async def test_each_run_has_its_own_key_even_within_one_second(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("keys")
    s = Scheduler(pool)
    keys: list[str] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        keys.append(slot.key)

    await s.add(name, "* * * * * *", handler=handler, allow_overlap=True)
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(keys) >= 1)
        for _ in range(3):
            await s.trigger(name)
        await wait_for(lambda: len(keys) >= 5)
    finally:
        await s.stop()
        await task
    slots = rows(dsn, name)
    assert len(keys) == len(set(keys)) <= len(slots)
    assert [k for k in keys if "." not in k], keys  # a scheduled slot, on a whole second
    # A whole-second slot keeps the readable form; a manual run's key names its microseconds.
    assert all(k.startswith(f"{name}@") for k in keys)
    assert any("." in k for k in keys)


def test_a_key_names_the_instant_to_the_microsecond() -> None:
    whole = dt.datetime(2026, 11, 29, 2, 0, tzinfo=UTC)
    assert Slot("nightly", whole, 1).key == "nightly@2026-11-29T02:00:00Z"
    later = whole + dt.timedelta(microseconds=1500)
    assert Slot("nightly", later, 1).key == "nightly@2026-11-29T02:00:00.001500Z"
    assert Slot("nightly", later, 1, manual=True).key != Slot("nightly", whole, 1).key


# -- backfill over a pause ----------------------------------------------------------------


async def test_a_backfill_over_a_pause_records_its_slots_skipped_and_runs_the_others(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("backfill-pause")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    start = db_now(dsn)
    await s.add(name, "* * * * * *", handler=handler)
    await asyncio.sleep(1.2)
    await s.pause(name)
    paused = db_now(dsn)
    await asyncio.sleep(2.2)
    resuming = db_now(dsn)
    await s.resume(name)
    await asyncio.sleep(1.2)
    done = await s.backfill(name, start, db_now(dsn))
    got = {r[0]: r for r in rows(dsn, name)}
    inside = [at for at in got if paused < at <= resuming]
    assert len(inside) >= 2
    assert {(got[at][1], got[at][2]) for at in inside} == {("skipped", "paused")}
    assert not [r for r in ran if paused < r.at <= resuming]
    assert done and all(not (paused < r.at <= resuming) for r in done)


async def test_a_backfill_waits_for_a_run_going_when_the_job_must_not_overlap(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("backfill-overlap")
    s = Scheduler(pool)
    peak = Peak(1.0)
    s.job(handler)(peak.body)
    start = db_now(dsn)
    await s.add(name, "* * * * * *", handler=handler)
    await asyncio.sleep(2.2)
    end = db_now(dsn)
    trigger = asyncio.create_task(s.trigger(name))
    await wait_for(lambda: peak.now == 1)
    await s.backfill(name, start, end)
    await trigger
    assert peak.peak == 1 and len(peak.ran) >= 3


# -- a schedule removed and added again -----------------------------------------------------


async def test_a_schedule_removed_and_added_again_runs_as_added(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("readded")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    await s.add(name, "* * * * * *", handler=handler, args={"v": 1})
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(ran) >= 1)
        # In one transaction: the replica sees the new row at the same version as the old.
        with psycopg.connect(dsn, autocommit=False) as conn:
            conn.execute("select pgcoord.schedule_remove(%s)", (name,))
            conn.execute("select pgcoord.schedule_add(%s, %s, '*/2 * * * * *', 'UTC', %s, '{}')",
                         (name, handler, json.dumps({"v": 2})))
        readded = db_now(dsn)
        await asyncio.sleep(3.5)
    finally:
        await s.stop()
        await task
    later = [r for r in ran if r.at > readded + dt.timedelta(seconds=1.1)]
    assert later
    assert all(r.args == {"v": 2} for r in later), [(r.at, r.args) for r in later]
    assert all(r.at.second % 2 == 0 for r in later)


# -- migration 0008 -----------------------------------------------------------------------


def test_0008_keeps_the_pauses_there_were_and_goes_down_and_up_again(fresh_db: str) -> None:
    import pgcoord.migrations

    pgcoord.migrations.upgrade(fresh_db, "0007")
    paused, resumed, never = unique("paused"), unique("resumed"), unique("never")
    for name in (paused, resumed, never):
        sql(fresh_db, "select pgcoord.schedule_add(%s, 'h', '* * * * *', 'UTC', '{}', '{}')", name)
    sql(fresh_db, "select pgcoord.schedule_pause(%s)", paused)
    sql(fresh_db, "select pgcoord.schedule_pause(%s)", resumed)
    sql(fresh_db, "select pgcoord.schedule_resume(%s)", resumed)
    sql(fresh_db, "insert into pgcoord.job_slots (job, slot_at, state) values (%s, now(), 'missed')", never)
    before = sql(fresh_db, "select name, paused, paused_at, resumed_at, version from pgcoord.schedules"
                           " order by name")
    pgcoord.migrations.upgrade(fresh_db)
    assert sql(fresh_db, "select name, paused_at, resumed_at from pgcoord.schedule_pauses order by name") == [
        (r[0], r[2], None if r[1] else r[3]) for r in before if r[2] is not None]
    # Upgraded in place: the schedules and their slots are as they were.
    assert sql(fresh_db, "select name, paused, paused_at, resumed_at, version from pgcoord.schedules"
                         " order by name") == before
    assert sql(fresh_db, "select count(*) from pgcoord.job_slots where job = %s", never) == [(1,)]
    sql(fresh_db, "select pgcoord.schedule_resume(%s)", paused)
    pgcoord.migrations.downgrade(fresh_db, "0007")
    assert sql(fresh_db, "select to_regclass('pgcoord.schedule_pauses')") == [(None,)]
    assert len(sql(fresh_db, "select 1 from pgcoord.schedules where name in (%s, %s, %s)",
                   paused, resumed, never)) == 3
    # 0006's functions are back and work.
    sql(fresh_db, "select pgcoord.schedule_pause(%s)", never)
    assert sql(fresh_db, "select count(*) from"
                         " pgcoord.schedule_take_owed('{}', '{}', '{}', '{}', 'r')") == [(0,)]
    pgcoord.migrations.upgrade(fresh_db)
    assert sql(fresh_db, "select name from pgcoord.schedule_pauses where name = %s", never) == [(never,)]


async def test_a_changed_expression_in_code_decides_the_old_slots_due_before_it(
        dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("recoded-old")
    old = Scheduler(pool)
    old.cron(name, "* * * * * *")(_noop)
    await _run_for(old, 1.5)
    await asyncio.sleep(2.2)  # the old expression's slots come due, no replica records them
    new = Scheduler(pool)
    new.cron(name, "0 0 1 1 *")(_noop)
    changed = db_now(dsn)
    await _run_for(new, 1.5)
    since = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    assert isinstance(since, dt.datetime) and since >= changed
    scheduled = [r for r in rows(dsn, name) if not r[3]]
    # Every second of the old expression up to the change has a row; catch_up latest:
    # the latest runs (late, as its own slot), those before it are missed.
    secs = [int(r[0].timestamp()) for r in scheduled]
    assert secs == list(range(secs[0], secs[-1] + 1))
    assert secs[-1] >= int(changed.timestamp()) - 1
    late = [r for r in scheduled if r[2] == "changed"]
    assert len(late) >= 1 and {r[1] for r in late} == {"missed"}
    assert scheduled[-1][1] == "succeeded"


@pytest.mark.parametrize("second", ["trigger", "decide"])
def test_two_runs_of_a_job_that_must_not_overlap_claimed_at_once_never_both_run(
        dsn: str, second: str) -> None:
    """Two replicas claim runs of one job at the same moment: each statement looks for
    a run going in its own snapshot, and neither sees the other's. Before: both ran.
    Now the second waits for the first (job_slots_one_alone) and does not run."""
    import threading

    job = unique("alone-race")
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '* * * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    version = sql(dsn, "select version from pgcoord.schedules where name = %s", job)[0][0]
    with psycopg.connect(dsn) as first, psycopg.connect(dsn, autocommit=True) as other:
        first.execute("select * from pgcoord.job_claim(%s, clock_timestamp(), 'first', 30000, 'skip', true)",
                      (job,))
        got: list[object] = []

        def claim() -> None:
            if second == "trigger":
                got.extend(other.execute(
                    "select * from pgcoord.job_claim(%s, clock_timestamp(), 'other', 30000, 'skip', true)",
                    (job,)).fetchall())
            else:
                got.extend(other.execute(
                    "select * from pgcoord.schedule_decide(array[%s], array[date_trunc('minute', now())],"
                    " array[%s::bigint], array['run'], array[NULL::text], array['skip'], array[30000::bigint],"
                    " 'other')", (job, version)).fetchall())

        thread = threading.Thread(target=claim)
        thread.start()
        time.sleep(0.5)  # the other claim waits on the first's uncommitted run
        first.commit()
        thread.join(10)
        assert not thread.is_alive()
    assert sql(dsn, "select count(*) from pgcoord.job_slots where job = %s and state = 'running'",
               job) == [(1,)]
    # The second is told to wait (its slot is decided again once the first is seen).
    assert [row[2 if second == "decide" else 0] for row in got] == ["waiting"], got  # type: ignore[index]
