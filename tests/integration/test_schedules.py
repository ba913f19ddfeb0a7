"""Schedules at runtime (docs/schedules.md) in one process: add, update, pause, resume,
remove, timeout, backfill, alerts, the SQL functions and the CLI."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import psycopg
import pytest

import pgcoord
from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique
from .sources import open_async

UTC = dt.UTC
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    yield p
    await p.close()


def rows(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, state, reason, manual from pgcoord.job_slots"
                    " where job = %s order by slot_at", job)


def db_now(dsn: str) -> dt.datetime:
    value = sql(dsn, "select clock_timestamp()")[0][0]
    assert isinstance(value, dt.datetime)
    return value


async def wait_for(check: Any, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_an_added_schedule_runs_with_its_args_and_a_change_reaches_the_loop_within_a_second(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("greet"), unique("greet:team-42")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def greet(slot: Slot) -> None:
        ran.append(slot)

    task = asyncio.create_task(s.run())
    try:
        await asyncio.sleep(0.3)  # the loop runs and has loaded nothing of ours
        added_at = db_now(dsn)
        await s.add(name, "* * * * * *", handler=handler, args={"team": 42})
        await wait_for(lambda: len(ran) >= 2)
        changed = await s.update(name, args={"team": 43})
        await wait_for(lambda: ran[-1].args == {"team": 43})
    finally:
        await s.stop()
        await task
    assert ran[0].args == {"team": 42} and ran[0].job == name
    first = [r for r in rows(dsn, name) if not r[3]]
    # Seen at the next tick: the first slot after the add started within a second of it.
    assert first[0][0] <= added_at + dt.timedelta(seconds=2)
    starts = sql(dsn, "select extract(epoch from started_at - slot_at) from pgcoord.job_slots"
                      " where job = %s", name)
    assert all(float(lag) < 1.0 for (lag,) in starts)
    # The args change applied to runs after it: no slot ran twice, all succeeded.
    assert [r[1] for r in first] == ["succeeded"] * len(first)
    assert len({slot.at for slot in ran}) == len(ran)
    assert changed.args == {"team": 43} and changed.version == 2


async def test_a_new_expression_counts_afresh_and_the_old_slots_due_before_it_get_rows(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("reexpr")
    s = Scheduler(pool)
    s.job(handler)(_noop)
    await s.add(name, "* * * * * *", handler=handler)
    await asyncio.sleep(2.3)  # no replica runs: the old expression's slots are due, unrecorded
    info = await s.update(name, expr="*/2 * * * * *")
    changed_at = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    task = asyncio.create_task(s.run())
    await asyncio.sleep(2.5)
    await s.stop()
    await task
    before = [r for r in rows(dsn, name) if r[0] <= changed_at]
    # The old expression's slots due before the change: the schedule's catch_up
    # (latest) applies to them, so the latest runs (late, as a scheduled slot)
    # and the earlier ones are recorded missed, reason 'changed'.
    assert len(before) >= 2
    assert {(r[1], r[2]) for r in before[:-1]} == {("missed", "changed")}
    assert (before[-1][1], before[-1][3]) == ("succeeded", False)
    assert [int(r[0].timestamp()) for r in before] == list(
        range(int(before[0][0].timestamp()), int(before[-1][0].timestamp()) + 1))
    after = [r for r in rows(dsn, name) if r[0] > changed_at]
    assert after and all(int(r[0].timestamp()) % 2 == 0 for r in after)
    assert {r[1] for r in after} == {"succeeded"}
    assert info.expr == "*/2 * * * * *"


async def test_paused_slots_are_recorded_skipped_and_resume_latest_runs_one_now(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("pausing")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    await s.add(name, "* * * * * *", handler=handler)
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(ran) >= 1)
        await s.pause(name)
        paused_at = db_now(dsn)
        await asyncio.sleep(2.2)
        ran_in_pause = [r for r in ran if r.at > paused_at]
        await s.resume(name, catch_up="latest")
        await wait_for(lambda: any(r.manual for r in ran))
        await asyncio.sleep(1.2)
    finally:
        await s.stop()
        await task
    assert ran_in_pause == []
    scheduled = [r for r in rows(dsn, name) if not r[3]]
    # Every second has a row: run before the pause, skipped in it, run after.
    secs = [int(r[0].timestamp()) for r in scheduled]
    assert secs == list(range(secs[0], secs[-1] + 1))
    skipped = [r for r in scheduled if r[1] == "skipped"]
    assert len(skipped) >= 2 and {r[2] for r in skipped} == {"paused"}
    assert all(r[0] > paused_at for r in skipped)
    assert [r for r in scheduled if r[0] > skipped[-1][0]], "runs went on after the resume"
    assert len([r for r in ran if r.manual]) == 1


async def test_resume_latest_owes_a_run_when_a_slot_fell_in_the_pause_with_no_replica_running(
        dsn: str, pool: asyncpg.Pool) -> None:
    """No replica ran during the pause, so no slot of it was recorded skipped: the
    pause's slots are worked out from the expression, from SQL and the CLI alike."""
    handler = unique("h")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    every, by_sql, by_cli, never = (unique(n) for n in ("every", "sql", "cli", "never"))
    for name in (every, by_sql, by_cli):
        await s.add(name, "* * * * * *", handler=handler, paused=True)
    await s.add(never, "0 0 1 1 *", handler=handler, paused=True)  # no slot in the pause
    await asyncio.sleep(1.2)
    await s.resume(every, catch_up="latest")
    assert sql(dsn, "select pgcoord.schedule_resume(%s, 'latest')", by_sql) == [(True,)]
    out = cli(dsn, "resume", by_cli, "--catch-up", "latest")
    assert out.returncode == 0, out.stderr
    await s.resume(never, catch_up="latest")
    # A scheduled slot due in the same tick runs first: the owed run does not overlap
    # it (allow_overlap=False) and is taken at a later tick.
    for _ in range(100):
        await s.tick()
        if {r.job for r in ran if r.manual} == {every, by_sql, by_cli}:
            break
        await asyncio.sleep(0.1)
    await wait_for(lambda: {r.job for r in ran if r.manual} == {every, by_sql, by_cli})
    await asyncio.sleep(0.2)
    assert len([r for r in ran if r.manual]) == 3
    assert not sql(dsn, "select 1 from pgcoord.schedule_owed where name = %s", never)
    assert not [r for r in rows(dsn, never) if r[3]]


async def test_a_removed_schedule_finishes_its_running_slot_and_starts_no_more(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("removed")
    s = Scheduler(pool)
    started = asyncio.Event()

    @s.job(handler)
    async def slow(slot: Slot) -> None:
        started.set()
        await asyncio.sleep(1.5)

    await s.add(name, "* * * * * *", handler=handler, allow_overlap=True)
    task = asyncio.create_task(s.run())
    try:
        await asyncio.wait_for(started.wait(), 10)
        await s.remove(name)
        removed_at = db_now(dsn)
        await asyncio.sleep(2.5)
    finally:
        await s.stop()
        await task
    found = rows(dsn, name)
    assert found and all(r[0] <= removed_at for r in found)
    assert "running" not in {r[1] for r in found} and "succeeded" in {r[1] for r in found}
    assert sql(dsn, "select count(*) from pgcoord.schedules where name = %s", name) == [(0,)]


async def test_a_job_past_its_timeout_is_cancelled_and_recorded_failed_timeout(
        dsn: str, pool: asyncpg.Pool) -> None:
    plain, tx = unique("slow"), unique("slow-tx")
    s = Scheduler(pool)
    cancelled: list[str] = []
    sql(dsn, "create table if not exists timeout_effects (job text)")

    async def forever(slot: Slot) -> None:
        try:
            if slot.conn is not None:
                await slot.conn.execute("insert into timeout_effects values ($1)", slot.job)
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(slot.job)
            raise

    s.job(plain)(forever)
    s.job(tx, transactional=True)(forever)
    await s.add(plain, "* * * * * *", handler=plain, timeout=0.3)
    await s.add(tx, "* * * * * *", handler=tx, timeout=0.3)
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(sql(dsn, "select 1 from pgcoord.job_slots where job in (%s, %s)"
                                            " and state = 'failed'", plain, tx)) >= 2)
    finally:
        await s.stop()
        await task
    for job in (plain, tx):
        failed = sql(dsn, "select reason, error from pgcoord.job_slots where job = %s"
                          " and state = 'failed'", job)
        assert failed and failed[0][0] == "timeout" and "0.3" in str(failed[0][1])
        assert job in cancelled
    assert sql(dsn, "select count(*) from timeout_effects where job = %s", tx) == [(0,)]


async def test_backfill_runs_each_past_slot_once_across_both_dst_transitions(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("paris-nightly")
    ran: list[dt.datetime] = []
    a, b = Scheduler(pool, runner="a"), Scheduler(pool, runner="b")

    async def work(slot: Slot) -> None:
        ran.append(slot.at)
        await asyncio.sleep(0.01)

    a.job(handler)(work)
    b.job(handler)(work)
    await a.add(name, "30 2 * * *", handler=handler, tz="Europe/Paris")
    start = dt.datetime(2026, 3, 28, tzinfo=UTC)
    end = dt.datetime(2026, 3, 31, tzinfo=UTC)
    # Two backfills of the same range at once: each slot runs exactly once.
    first, second = await asyncio.gather(a.backfill(name, start, end), b.backfill(name, start, end))
    assert sorted(ran) == sorted(s.at for s in first + second)
    # 02:30 Paris; on 2026-03-29 02:30 does not exist and the slot runs at 03:00 CEST.
    assert sorted(ran) == [dt.datetime(2026, 3, 28, 1, 30, tzinfo=UTC),
                           dt.datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
                           dt.datetime(2026, 3, 30, 0, 30, tzinfo=UTC)]
    ran.clear()
    fall = await a.backfill(name, dt.datetime(2026, 10, 24, tzinfo=UTC),
                            dt.datetime(2026, 10, 26, 12, tzinfo=UTC))
    # 02:30 happens twice on 2026-10-25: it runs once, the first time (00:30 UTC).
    assert [s.at for s in fall] == [dt.datetime(2026, 10, 24, 0, 30, tzinfo=UTC),
                                    dt.datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
                                    dt.datetime(2026, 10, 26, 1, 30, tzinfo=UTC)]
    assert await a.backfill(name, start, end) == []  # done already: nothing runs again
    states = {r[1] for r in rows(dsn, name)}
    assert states == {"succeeded"} and len(rows(dsn, name)) == 6
    with pytest.raises(ValueError, match="future"):
        await a.backfill(name, start, dt.datetime.now(UTC) + dt.timedelta(days=1))


async def test_a_schedule_that_keeps_failing_is_logged_and_counted(
        dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    handler, failing, fine = unique("h"), unique("failing"), unique("fine")
    s = Scheduler(pool, alert_after=3)

    @s.job(handler)
    async def work(slot: Slot) -> None:
        if slot.args.get("fail"):
            raise RuntimeError("broken")

    await s.add(failing, "* * * * * *", handler=handler, args={"fail": True})
    await s.add(fine, "* * * * * *", handler=handler)
    task = asyncio.create_task(s.run())
    try:
        await asyncio.sleep(4.3)
        with caplog.at_level(logging.WARNING, logger="pgcoord.metrics"):
            found = await s.check_failing()
    finally:
        await s.stop()
        await task
    assert failing in found and fine not in found
    events = [r for r in caplog.records if getattr(r, "pgcoord", {}).get("event") == "job_failing"]
    names = [e.pgcoord["name"] for e in events]  # type: ignore[attr-defined]
    assert failing in names and fine not in names
    info = {i.name: i for i in await s.schedules()}
    assert info[failing].failures_in_row >= 3 and info[fine].failures_in_row == 0
    import prometheus_client

    assert prometheus_client.REGISTRY.get_sample_value(
        "pgcoord_jobs_failing", {"handler": handler}) == 1.0


@pytest.mark.parametrize(("kind", "overlap"), [
    ("asyncpg-pool", False), ("asyncpg-pool", True), ("psycopg-pool", False),
    ("sa-async-asyncpg", False), ("sa-async-psycopg", False)])
async def test_runs_going_do_not_hide_the_failures_before_them(
        dsn: str, kind: str, overlap: bool) -> None:
    """A schedule whose newest slots are still running, beside slots that failed,
    is failing: a run going does not hide the failures beside it. (A job that fails
    after running most of its period would otherwise almost never alert; a loaded
    machine, whose records of failed runs land late, hid one in CI.)"""
    handler, name = unique("h"), unique("slow-failing")
    failures, going, release = 0, 0, asyncio.Event()
    enough_going = asyncio.Event()
    async with open_async(kind, dsn) as source:
        s = Scheduler(source, alert_after=3)

        @s.job(handler)
        async def work(slot: Slot) -> None:
            nonlocal failures, going
            if failures >= 3:
                going += 1
                if going == (2 if overlap else 1):
                    enough_going.set()
                await release.wait()
            failures += 1
            raise RuntimeError("broken")

        await s.add(name, "* * * * * *", handler=handler, allow_overlap=overlap)
        task = asyncio.create_task(s.run())
        try:
            await asyncio.wait_for(enough_going.wait(), 30)
            found = await s.check_failing()
            states = [r[1] for r in rows(dsn, name)]
        finally:
            release.set()
            await s.stop()
            await task
    assert states.count("running") >= (2 if overlap else 1), states
    assert states.count("failed") >= 3, states
    assert name in found


async def test_a_slow_job_that_succeeds_is_never_failing(dsn: str, pool: asyncpg.Pool) -> None:
    """A job whose runs take 2.5 of its periods (less than K) and succeed: the slots
    skipped while one goes and the run going are not failures, at any moment of its
    cycle."""
    seconds = 2.5
    handler, name = unique("h"), unique("slow-fine")
    s = Scheduler(pool, alert_after=3)

    @s.job(handler)
    async def work(slot: Slot) -> None:
        await asyncio.sleep(seconds)

    await s.add(name, "* * * * * *", handler=handler)
    task = asyncio.create_task(s.run())
    flagged, looks = [], 0
    try:
        began = time.monotonic()
        while time.monotonic() - began < 9:
            looks += 1
            if name in await s.check_failing():
                flagged.append(round(time.monotonic() - began, 2))
            await asyncio.sleep(0.2)
        states = [r[1] for r in rows(dsn, name)]
    finally:
        await s.stop()
        await task
    assert "succeeded" in states and "skipped" in states, states
    assert looks >= 20 and flagged == [], (flagged, states)


@pytest.mark.parametrize("overlap", [False, True], ids=["alone", "overlapping"])
async def test_a_job_whose_runs_fail_after_k_periods_is_failing(
        dsn: str, pool: asyncpg.Pool, overlap: bool) -> None:
    """Runs that take 4.5 of the job's periods and fail: the span of the last K=3
    slots holds only runs going or slots skipped while one went, and the run that
    failed started before it. The latest run that ended failed, so a run going does
    not clear the schedule."""
    handler, name = unique("h"), unique("long-failing")
    s = Scheduler(pool, alert_after=3)

    @s.job(handler)
    async def work(slot: Slot) -> None:
        await asyncio.sleep(4.5)
        raise RuntimeError("broken")

    await s.add(name, "* * * * * *", handler=handler, allow_overlap=overlap)
    task = asyncio.create_task(s.run())
    try:
        began = time.monotonic()
        # Until a run fails and another goes (the premise: a run going now).
        while not {"failed", "running"} <= {r[1] for r in rows(dsn, name)}:
            assert time.monotonic() - began < 30, rows(dsn, name)
            await asyncio.sleep(0.1)
        flagged = [name in await s.check_failing() for _ in range(3)]
        states = [r[1] for r in rows(dsn, name)]
    finally:
        await s.stop(drain=0)
        await task
    assert "running" in states, states
    assert all(flagged), (flagged, states)


async def test_a_hung_run_is_failing_once_k_periods_have_passed(
        dsn: str, pool: asyncpg.Pool) -> None:
    """Two runs succeed, then one hangs, its replica alive (its claim renewed) and
    every later slot skipped: once the span of the last K slots starts after the hung
    run's slot, the run going clears nothing, and the schedule is failing."""
    handler, name = unique("h"), unique("hung")
    s = Scheduler(pool, alert_after=2)
    ran, release = 0, asyncio.Event()

    @s.job(handler)
    async def work(slot: Slot) -> None:
        nonlocal ran
        ran += 1
        if ran > 2:
            await release.wait()

    await s.add(name, "* * * * * *", handler=handler)
    task = asyncio.create_task(s.run())
    try:
        began = time.monotonic()
        while ran <= 2:  # the premise: the hung run has started
            assert time.monotonic() - began < 30, rows(dsn, name)
            await asyncio.sleep(0.05)
        while name not in await s.check_failing():
            assert time.monotonic() - began < 30, rows(dsn, name)
            await asyncio.sleep(0.2)
        states = [r[1] for r in rows(dsn, name)]
    finally:
        release.set()
        await s.stop()
        await task
    assert states.count("succeeded") == 2 and states.count("running") == 1, states
    assert states[-1] == "skipped", states


async def test_a_run_going_after_a_graceful_stop_is_not_failing(
        dsn: str, pool: asyncpg.Pool) -> None:
    """A replica stopped mid-run (a rolling deploy) records the run abandoned
    ('stopped'); another replica's run going after it is not failing for that: a
    graceful stop is not the job's failure."""
    handler, name = unique("h"), unique("rolled")
    started: list[str] = []
    replicas = [Scheduler(pool, alert_after=3) for _ in range(2)]
    for label, sched in zip("ab", replicas, strict=True):

        @sched.job(handler)
        async def work(slot: Slot, label: str = label) -> None:
            started.append(label)
            await asyncio.sleep(2.5)

    a, b = replicas
    await a.add(name, "* * * * * *", handler=handler)
    await asyncio.sleep(3.2)  # K slots since the schedule was added: it is judged
    first = asyncio.create_task(a.run())
    began = time.monotonic()
    while started != ["a"]:
        assert time.monotonic() - began < 30, rows(dsn, name)
        await asyncio.sleep(0.05)
    await a.stop(drain=0)
    await first
    assert [(r[1], r[2]) for r in rows(dsn, name) if r[1] == "abandoned"] == [("abandoned", "stopped")]
    second = asyncio.create_task(b.run())
    try:
        while "b" not in started:
            assert time.monotonic() - began < 30, rows(dsn, name)
            await asyncio.sleep(0.05)
        flagged = [name in await b.check_failing() for _ in range(3)]
        states = [r[1] for r in rows(dsn, name)]
    finally:
        await b.stop()
        await second
    assert "running" in states and "succeeded" not in states, states
    assert not any(flagged), states


DEAD_RUNNER = """
import asyncio, sys
import asyncpg
from pgcoord.scheduler import Scheduler

async def main(dsn, handler):
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    s = Scheduler(pool)

    @s.job(handler, claim_ttl=2.0)
    async def work(slot):
        await asyncio.sleep(3600)

    await s.run()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_run_whose_runner_died_does_not_hide_the_schedule(
        dsn: str, pool: asyncpg.Pool) -> None:
    """The only replica with the handler is SIGKILLed mid-run, and no replica left
    reaps its claim (none has the handler): the row says 'running' for ever. A run
    going clears a schedule only while its claim is alive, so it is failing once
    the claim has expired."""
    handler, name = unique("h"), unique("dead-runner")
    s = Scheduler(pool, alert_after=3)
    await s.add(name, "* * * * * *", handler=handler)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", DEAD_RUNNER, dsn, handler, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        began = time.monotonic()
        while "running" not in [r[1] for r in rows(dsn, name)]:
            assert time.monotonic() - began < 30 and child.returncode is None, rows(dsn, name)
            await asyncio.sleep(0.1)
    finally:
        child.kill()  # SIGKILL: no cleanup, the claim is left to expire
        await child.wait()
    killed = time.monotonic()
    while name not in await s.check_failing():
        assert time.monotonic() - killed < 20, rows(dsn, name)
        await asyncio.sleep(0.2)
    assert [r[1] for r in rows(dsn, name)][-1] == "running"  # nobody reaped it


async def test_bad_input_is_refused_at_the_call(dsn: str, pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    name = unique("bad")
    with pytest.raises(ValueError, match="cron"):
        await s.add(name, "61 * * * *", handler="h")
    with pytest.raises(ValueError, match="time zone"):
        await s.add(name, "* * * * *", handler="h", tz="Mars/Olympus_Mons")
    with pytest.raises(ValueError):
        await s.add(name, "* * * * *", handler="h", on_crash="sometimes")
    with pytest.raises(ValueError):
        await s.add(name, "* * * * *", handler="")
    with pytest.raises(TypeError, match="JSON"):
        await s.add(name, "* * * * *", handler="h", args={"when": dt.datetime.now()})
    with pytest.raises(ValueError):
        await s.add(name, "* * * * *", handler="h", timeout=0)
    await s.add(name, "* * * * *", handler="h")
    with pytest.raises(ValueError, match="exists"):
        await s.add(name, "* * * * *", handler="h")
    with pytest.raises(TypeError, match="unknown"):
        await s.update(name, every="day")
    with pytest.raises(ValueError, match="cron"):
        await s.update(name, expr="every day")
    with pytest.raises(ValueError, match="catch_up"):
        await s.resume(name, catch_up="all")
    for call in (s.pause, s.remove):
        with pytest.raises(ValueError, match="no schedule"):
            await call(unique("missing"))
    with pytest.raises(ValueError, match="no schedule"):
        await s.update(unique("missing"), expr="* * * * *")
    code = unique("in-code")
    s.cron(code, "0 0 1 1 *")(_noop)
    await s._register()
    with pytest.raises(ValueError, match="in code"):
        await s.update(code, expr="* * * * *")
    with pytest.raises(ValueError, match="in code"):
        await s.remove(code)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="in code"):
        sql(dsn, "select pgcoord.schedule_remove(%s)", code)
    await s.pause(code)  # pausing a code schedule is an operator's call: allowed
    assert {i.name: i.paused for i in await s.schedules()}[code] is True


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PGCOORD_DSN": dsn}
    return subprocess.run([sys.executable, "-m", "pgcoord.cli", "jobs", *args],
                          capture_output=True, text=True, env=env, timeout=60)


async def test_sql_functions_and_the_cli_pause_resume_trigger_and_show_history(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("cli")
    s = Scheduler(pool)
    ran: list[Slot] = []

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    await s.add(name, "0 0 1 1 *", handler=handler, tz="Europe/Paris", args={"k": 1})
    task = asyncio.create_task(s.run())
    try:
        out = cli(dsn, "trigger", name)
        assert out.returncode == 0, out.stderr
        await wait_for(lambda: len(ran) == 1)  # a running replica with the handler ran it
        assert ran[0].manual and ran[0].args == {"k": 1}
        # Its end is recorded just after the body returns, by this event loop: let it
        # be, before the blocking CLI calls below hold the loop.
        await wait_for(lambda: sql(dsn, "select count(*) from pgcoord.job_slots where job = %s"
                                        " and state = 'succeeded'", name) == [(1,)])
        assert cli(dsn, "pause", name).returncode == 0
        assert sql(dsn, "select paused from pgcoord.schedules where name = %s", name) == [(True,)]
        assert sql(dsn, "select pgcoord.schedule_resume(%s)", name) == [(True,)]
        assert sql(dsn, "select pgcoord.schedule_pause(%s)", unique("missing")) == [(False,)]
        listing = cli(dsn)
        assert listing.returncode == 0
        line = next(ln for ln in listing.stdout.splitlines() if ln.startswith(name))
        assert "0 0 1 1 *" in line and "Europe/Paris" in line and "succeeded" in line
        as_json = {i["name"]: i for i in json.loads(cli(dsn, "--json").stdout)}
        assert as_json[name]["paused"] is False and as_json[name]["failures_in_row"] == 0
        new_year = dt.datetime(db_now(dsn).year + 1, 1, 1, tzinfo=ZoneInfo("Europe/Paris"))
        assert dt.datetime.fromisoformat(as_json[name]["next_run_at"]) == new_year
        history = json.loads(cli(dsn, "history", name, "--json").stdout)
        assert [(h["state"], h["manual"]) for h in history] == [("succeeded", True)]
        missing = cli(dsn, "pause", unique("missing"))
        assert missing.returncode == 6 and "no schedule" in missing.stderr
    finally:
        await s.stop()
        await task


async def _noop(slot: Slot) -> None:
    pass


@pytest.mark.parametrize("kind", ["psycopg-pool", "sa-async-asyncpg", "sa-async-psycopg"])
async def test_every_driver_adds_runs_pauses_and_records_in_batches(dsn: str, kind: str) -> None:
    from .sources import open_async

    handler, name = unique("h"), unique(f"driver:{kind}")
    ran: list[Slot] = []
    async with open_async(kind, dsn) as source:
        s = Scheduler(source)

        @s.job(handler, claim_ttl=1.0)
        async def work(slot: Slot) -> None:
            ran.append(slot)
            if len(ran) == 2:
                raise RuntimeError("second run fails")

        await s.add(name, "* * * * * *", handler=handler, args={"kind": kind}, timeout=5)
        task = asyncio.create_task(s.run())
        try:
            await wait_for(lambda: len(ran) >= 3)
            await s.pause(name)
            paused_at = db_now(dsn)
            await asyncio.sleep(1.5)
            await s.update(name, expr="*/2 * * * * *")
        finally:
            await s.stop()
            await task
        infos = {i.name: i for i in await s.schedules()}
    assert ran[0].args == {"kind": kind}
    found = rows(dsn, name)
    states = [r[1] for r in found if r[0] <= paused_at]
    assert states.count("failed") == 1 and states.count("succeeded") >= 2
    assert [r[2] for r in found if r[0] > paused_at and r[1] == "skipped"] != []
    assert infos[name].paused and infos[name].expr == "*/2 * * * * *"


async def test_with_a_member_a_change_is_heard_at_once_not_at_the_next_poll(
        dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    handler, name = unique("h"), unique("heard")
    ran: list[Slot] = []
    async with pgcoord.Member(dsn, group=unique("listen")) as member:
        # A 30 s tick: without the NOTIFY the loop would not look again for 30 s.
        s = Scheduler(pool, member=member, tick=30)

        @s.job(handler)
        async def work(slot: Slot) -> None:
            ran.append(slot)

        task = asyncio.create_task(s.run())
        try:
            with caplog.at_level(logging.WARNING, logger="pgcoord.scheduler"):
                await asyncio.sleep(0.5)
                await s.add(name, "* * * * * *", handler=handler)
                await wait_for(lambda: len(ran) >= 1, within=5)
        finally:
            await s.stop()
            await task
    # A replica that starts before any of its schedules exists ticks without failing.
    assert not [r for r in caplog.records if "tick failed" in r.getMessage()]


def _epoch(dsn: str) -> int:
    value = sql(dsn, "select epoch from pgcoord.schedule_epoch")[0][0]
    assert isinstance(value, int)
    return value


async def test_statements_that_change_no_schedule_neither_bump_the_counter_nor_notify(
        dsn: str, pool: asyncpg.Pool) -> None:
    """Every replica reloads all its schedules when the counter moves: a statement
    that changed nothing (a start that declares what is there) must not move it."""
    s = Scheduler(pool)
    name = unique("still")
    await s.add(name, "0 0 1 1 *", handler=unique("h"))
    await s.pause(name)
    with psycopg.connect(dsn, autocommit=True) as listener:
        # Registered as a listener (0010): news nobody listens to is not told at all.
        listener.execute("select pgcoord.ears_open('pgcoord_schedules')")
        listener.execute("listen pgcoord_schedules")
        before = _epoch(dsn)
        sql(dsn, "select pgcoord.schedule_declare('[]')")
        assert sql(dsn, "select pgcoord.schedule_pause(%s)", unique("missing")) == [(False,)]
        assert sql(dsn, "select pgcoord.schedule_pause(%s)", name) == [(True,)]  # paused already
        assert sql(dsn, "select pgcoord.schedule_resume(%s)", unique("missing")) == [(False,)]
        assert sql(dsn, "select pgcoord.schedule_remove(%s)", unique("missing")) == [(False,)]
        sql(dsn, "update pgcoord.schedules set paused = true where false")
        assert _epoch(dsn) == before
        assert list(listener.notifies(timeout=0.5, stop_after=1)) == []
        await s.resume(name)  # a real change still moves it, once
        assert _epoch(dsn) == before + 1
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == [str(before + 1)]


async def test_a_replica_starts_and_runs_while_another_session_holds_a_change_open(
        dsn: str, pool: asyncpg.Pool) -> None:
    """A change not yet committed holds the counter's row; a replica starting then
    must not wait for it to run what it can (its code's new schedule follows later)."""
    handler, existing, in_code, other = unique("h"), unique("existing"), unique("code"), unique("o")
    admin = Scheduler(pool)
    await admin.add(existing, "* * * * * *", handler=handler)
    await admin.add(other, "0 0 1 1 *", handler=unique("h"))
    ran: list[Slot] = []
    s = Scheduler(pool)

    @s.job(handler)
    async def work(slot: Slot) -> None:
        ran.append(slot)

    @s.cron(in_code, "* * * * * *")
    async def coded(slot: Slot) -> None:
        ran.append(slot)

    with psycopg.connect(dsn) as holder:
        holder.execute("select pgcoord.schedule_pause(%s)", (other,))  # open, not committed
        task = asyncio.create_task(s.run())
        try:
            await wait_for(lambda: any(r.job == existing for r in ran), within=8)
            holder.commit()
            await wait_for(lambda: any(r.job == in_code for r in ran), within=8)
        finally:
            holder.rollback()
            await s.stop()
            await task


async def test_a_trigger_heard_through_the_member_reloads_no_schedule(
        dsn: str, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("owed")
    ran: list[Slot] = []
    async with pgcoord.Member(dsn, group=unique("owed")) as member:
        s = Scheduler(pool, member=member, tick=30)

        @s.job(handler)
        async def work(slot: Slot) -> None:
            ran.append(slot)

        await s.add(name, "0 0 1 1 *", handler=handler)
        reloads = 0
        real_reload = s._reload

        async def counted() -> None:
            nonlocal reloads
            reloads += 1
            await real_reload()

        s._reload = counted  # type: ignore[method-assign]
        task = asyncio.create_task(s.run())
        try:
            await asyncio.sleep(0.5)
            loaded = reloads
            assert loaded >= 1
            for _ in range(3):
                sql(dsn, "select pgcoord.schedule_trigger(%s)", name)
                count = len(ran)
                await wait_for(lambda: len(ran) > count, within=5)  # heard at once (tick is 30 s)
        finally:
            await s.stop()
            await task
    assert reloads == loaded


async def test_a_change_that_waits_for_a_lock_counts_from_when_it_applies(
        dsn: str, pool: asyncpg.Pool) -> None:
    """A change whose UPDATE waits behind another transaction took its `since`
    before the wait, while replicas went on with the old expression after it."""
    handler, name = unique("h"), unique("waited")
    s = Scheduler(pool)
    s.job(handler)(_noop)
    await s.add(name, "* * * * * *", handler=handler)
    task = asyncio.create_task(s.run())
    try:
        await wait_for(lambda: len(rows(dsn, name)) >= 1)
        with psycopg.connect(dsn) as holder:
            # Conflicts with an UPDATE of the row; not with a replica's claims.
            holder.execute("select 1 from pgcoord.schedules where name = %s for no key update",
                           (name,))
            change = asyncio.create_task(s.update(name, expr="*/2 * * * * *"))
            await asyncio.sleep(2.5)
            assert not change.done()
            holder.rollback()
        await change
        await asyncio.sleep(2.2)
    finally:
        await s.stop()
        await task
    since = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    after = [r for r in rows(dsn, name) if r[0] > since and not r[3]]
    assert after and all(int(r[0].timestamp()) % 2 == 0 for r in after), after
    secs = [int(r[0].timestamp()) for r in rows(dsn, name) if r[0] <= since]
    assert secs == list(range(secs[0], secs[-1] + 1))  # every old slot has a row


async def test_a_change_records_every_unrecorded_old_slot_not_only_the_first_2000(
        dsn: str, pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    name = unique("backlog")
    await s.add(name, "* * * * * *", handler=unique("h"), catch_up="none")
    # Nobody ran it for an hour: 3600 slots with no row.
    sql(dsn, "update pgcoord.schedules set since = clock_timestamp() - interval '1 hour'"
             " where name = %s", name)
    await s.update(name, expr="0 0 1 1 *")
    since, start = sql(dsn, "select since, since - interval '1 hour' from pgcoord.schedules"
                            " where name = %s", name)[0]
    found = sql(dsn, "select count(*), min(slot_at), max(slot_at) from pgcoord.job_slots"
                     " where job = %s", name)[0]
    owed = sql(dsn, "select count(*) from pgcoord.schedule_owed where name = %s", name)[0][0]
    # Every old slot up to the change has a row or is owed (catch_up none: the last
    # second or two run late).
    assert found[0] + owed >= 3599 and owed <= 3
    assert found[1] <= start + dt.timedelta(seconds=5)


async def test_failing_alerts_judge_schedules_no_replica_runs_and_not_a_pause(
        dsn: str, pool: asyncpg.Pool) -> None:
    """A schedule whose handler no replica registers is failing silently; a
    schedule just resumed had no success in its pause's slots, and is not."""
    handler, orphan, resumed = unique("h"), unique("orphan"), unique("resumed")
    s = Scheduler(pool, alert_after=3)
    s.job(handler)(_noop)
    await s.add(orphan, "* * * * * *", handler=unique("nobody-has-it"))
    await s.add(resumed, "* * * * * *", handler=handler, paused=True)
    await asyncio.sleep(3.5)
    await s.resume(resumed)
    found = await s.check_failing()
    assert orphan in found
    assert resumed not in found


async def test_a_change_made_while_the_members_session_is_away_is_seen_when_it_is_back(
        dsn: str, pool: asyncpg.Pool) -> None:
    """The notification of a change made while the member's session is gone is
    lost; with a 30 s tick the loop would not look for 30 s."""
    handler, name = unique("h"), unique("while-away")
    ran: list[Slot] = []
    async with pgcoord.Member(dsn, group=unique("away"), ttl=3) as member:
        s = Scheduler(pool, member=member, tick=30)

        @s.job(handler)
        async def work(slot: Slot) -> None:
            ran.append(slot)

        def add_while_away(_old_id: int) -> None:
            # The old session is gone and the new one not LISTENing yet.
            sql(dsn, "select pgcoord.schedule_add(%s, %s, '* * * * * *', 'UTC', '{}', '{}')",
                name, handler)

        task = asyncio.create_task(s.run())
        try:
            await asyncio.sleep(0.5)
            unhook = member.on_session_lost(add_while_away)
            sql(dsn, "select pg_terminate_backend(%s)", member._main.backend_pid)
            await wait_for(lambda: any(r.job == name for r in ran), within=8)
            unhook()
        finally:
            await s.stop()
            await task


async def test_pause_and_resume_wait_for_claims_being_decided_and_count_from_then(
        dsn: str, pool: asyncpg.Pool) -> None:
    """A claim being decided holds its schedule FOR KEY SHARE until it commits; an
    UPDATE does not wait for that, so a pause could take its paused_at before a
    claim under the unpaused version committed for a later slot."""
    s = Scheduler(pool)
    name = unique("held")
    await s.add(name, "0 0 1 1 *", handler=unique("h"))
    for action in ("pause", "resume"):
        with psycopg.connect(dsn) as decider:  # as schedule_decide holds it
            decider.execute("select 1 from pgcoord.schedules where name = %s for key share", (name,))
            change = asyncio.create_task(getattr(s, action)(name))
            await asyncio.sleep(0.5)
            waited = not change.done()
            released = db_now(dsn)
            decider.rollback()
        await change
        assert waited, f"{action} did not wait for the claim being decided"
        column = "paused_at" if action == "pause" else "resumed_at"
        assert sql(dsn, f"select {column} from pgcoord.schedules where name = %s", name)[0][0] > released
