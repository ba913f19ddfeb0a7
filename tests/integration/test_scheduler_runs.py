"""A run and its claim (issue 22): the claim on the tenure engine, a timeout that
cancels until the body ends, the README's form tied to a session, and the reasons
each end is recorded with.

The crash test uses real processes (``scheduler_replica.py``) and SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique
from .converted_cancel import CONVERTED, Converting
from .test_scheduler_hostile import POOLS, open_pool

REPLICA = str(Path(__file__).with_name("scheduler_replica.py"))


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    yield p
    await p.close()


def rows_of(dsn: str, job: str) -> list[tuple[object, ...]]:
    return sql(dsn, "select state, reason, error from pgcoord.job_slots where job = %s"
                    " order by slot_at", job)


# -- a timeout cancels until the body has ended ------------------------------------------------


async def test_a_timed_out_body_that_takes_its_cancellation_for_an_error_is_cancelled_until_it_ends(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """The body retries on database errors, and the timeout's cancellation comes back
    as one: it is cancelled again until it ends, and recorded failed, reason timeout
    (it used to run on, its claim renewed for ever)."""
    job = unique("timeout-recancel")
    body = Converting()
    s = Scheduler(pool, runner="timeouts")

    @s.cron(job, "0 0 1 1 *", timeout=0.5, claim_ttl=6.0)
    async def retrying(slot: Slot) -> None:
        await body(slot)

    began = time.monotonic()
    await asyncio.wait_for(s.trigger(job), 10)
    assert body.errors == 1 and body.ended, "the body was never stopped"
    assert body.ended[0] - began < 3.0
    [(state, reason, error)] = rows_of(dsn, job)
    assert (state, reason) == ("failed", "timeout")
    assert "timeout of 0.5 s" in str(error)


async def test_a_timed_out_body_that_ends_with_the_converted_error_is_recorded_timeout(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """The body does not retry: the timeout's cancellation comes back as the driver's
    error, and the run is still recorded failed, reason timeout (it used to be
    recorded failed with reason NULL)."""
    job = unique("timeout-converted")
    body = Converting(retries=False)
    s = Scheduler(pool, runner="timeouts")

    @s.cron(job, "0 0 1 1 *", timeout=0.5)
    async def once(slot: Slot) -> None:
        await body(slot)

    await asyncio.wait_for(s.trigger(job), 10)
    [(state, reason, error)] = rows_of(dsn, job)
    assert (state, reason) == ("failed", "timeout")
    assert CONVERTED in str(error)


async def test_a_scheduled_slot_past_its_timeout_ends_and_its_claim_is_let_go(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """The issue's case in the loop: a per-second job with timeout 0.5 s whose body
    retries on the converted error. 6 s later no run of it is still going, and every
    slot that ran is recorded failed, reason timeout."""
    job = unique("timeout-loop")
    bodies: list[Converting] = []
    s = Scheduler(pool, runner="timeouts")

    @s.cron(job, "* * * * * *", timeout=0.5, claim_ttl=6.0, allow_overlap=True)
    async def retrying(slot: Slot) -> None:
        body = Converting()
        bodies.append(body)
        await body(slot)

    task = asyncio.create_task(s.run())
    await asyncio.sleep(6.0)
    still = sql(dsn, "select count(*) from pgcoord.job_slots where job = %s and state = 'running'"
                     " and started_at < clock_timestamp() - interval '3 seconds'", job)
    await s.stop()
    await task
    assert still == [(0,)], "a timed-out run was still going (its claim renewed) seconds later"
    assert bodies and all(b.ended for b in bodies)
    finished = [r for r in rows_of(dsn, job) if r[0] != "abandoned"]
    assert finished and {(state, reason) for state, reason, _ in finished} == {("failed", "timeout")}


# -- ends recorded with the right reason ------------------------------------------------------


async def test_a_body_stopped_by_stop_whose_cancellation_comes_back_as_an_error_is_recorded_stopped(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """stop(drain=0) cancels the body; its driver turns that into an error and it
    ends with it. That is a stopped run (abandoned, reason stopped), not a failure
    with reason NULL."""
    job = unique("stop-converted")
    started = asyncio.Event()
    body = Converting(retries=False)
    s = Scheduler(pool, runner="stopping")

    @s.cron(job, "* * * * * *")
    async def once(slot: Slot) -> None:
        started.set()
        await body(slot)

    task = asyncio.create_task(s.run())
    await asyncio.wait_for(started.wait(), 10)
    await s.stop(drain=0)
    await task
    assert body.errors == 1
    states = {(state, reason) for state, reason, _ in rows_of(dsn, job)}
    assert ("abandoned", "stopped") in states
    assert not any(state == "failed" for state, _ in states), states


async def test_a_record_that_fails_once_is_tried_again_while_the_claim_is_held(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """Recording the end fails once (a trigger on job_slots raises, as a lost
    connection or a serialization failure would): it is tried again while the claim
    is still ours, and the slot ends succeeded, not left running until its claim
    expires and then recorded abandoned ('runner lost')."""
    job = unique("record-fails")
    # A sequence counts the tries: nextval is not rolled back with the failed record.
    seq = f"record_tries_{uuid.uuid4().hex[:8]}"
    sql(dsn, f"create sequence {seq}")
    sql(dsn, f"""
        create or replace function pgcoord_test_fail_record() returns trigger language plpgsql as $$
        begin
            if new.job = '{job}' and new.state <> 'running' and old.state = 'running'
               and nextval('public.{seq}') = 1 then
                raise exception 'record refused once (test)';
            end if;
            return new;
        end $$""")
    sql(dsn, "drop trigger if exists fail_record on pgcoord.job_slots")
    sql(dsn, "create trigger fail_record before update on pgcoord.job_slots"
             " for each row execute function pgcoord_test_fail_record()")
    try:
        s = Scheduler(pool, runner="recording")

        @s.cron(job, "0 0 1 1 *", claim_ttl=30.0)
        async def quick(slot: Slot) -> None:
            pass

        await asyncio.wait_for(s.trigger(job), 15)
        assert sql(dsn, f"select last_value from {seq}") == [(2,)]
        assert [(r[0], r[1]) for r in rows_of(dsn, job)] == [("succeeded", None)]
    finally:
        sql(dsn, "drop trigger if exists fail_record on pgcoord.job_slots")


# -- the README's form is tied to a session ---------------------------------------------------


class Replicas:
    """Replicas of the README's form (``Scheduler(pool)``, claim_ttl 30 s) as processes."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.job = f"readme:{uuid.uuid4().hex[:6]}"
        sql(dsn, "create table if not exists job_starts (id serial primary key, job text,"
                 " slot_at timestamptz, attempt int, runner text)")
        sql(dsn, "alter table job_starts add column if not exists at timestamptz"
                 " default clock_timestamp()")
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, label: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen(
            [sys.executable, REPLICA, self.dsn, self.job, "skip", label, "readme"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_until(check: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(what)


def test_the_readme_form_runs_the_next_slot_within_a_second_of_a_sigkill(dsn: str) -> None:
    """Two replicas of ``Scheduler(pool)`` as written in the README (default claim_ttl
    of 30 s) run a per-second job; the one running a slot is SIGKILLed. The next slot
    starts on the other replica within a second or so, and the killed slot is
    recorded abandoned (it used to skip every slot, reason overlap, for 30 s)."""
    replicas = Replicas(dsn)
    job = replicas.job
    try:
        for label in ("a", "b"):
            replicas.spawn(label)

        def running() -> list[tuple[object, ...]]:
            return sql(dsn, "select slot_at, runner from pgcoord.job_slots where job = %s"
                            " and state = 'running'", job)

        # Both replicas up (each has run a slot, or a few seconds went by), then a run.
        wait_until(lambda: len({r for (r,) in sql(
            dsn, "select distinct runner from job_starts where job = %s", job)}) >= 2, 60,
            "the two replicas never both ran a slot")
        wait_until(running, 10, "no slot ran")
        [(killed_at_slot, runner)] = running()
        victim = next(p for p in replicas.procs if f":{p.pid}:" in str(runner))
        [(kill_at,)] = sql(dsn, "select clock_timestamp()")
        victim.kill()
        victim.wait()

        def next_start() -> list[tuple[object, ...]]:
            return sql(dsn, "select min(at) from job_starts where job = %s and slot_at > %s",
                       job, killed_at_slot)

        wait_until(lambda: next_start()[0][0] is not None, 40, "no slot ran after the kill")
        [(first_after,)] = next_start()
        gap = (first_after - kill_at).total_seconds()  # type: ignore[operator]
        print(f"\nnext slot started {gap:.3f} s after the SIGKILL")
        assert gap < 3.0, f"the next slot started {gap:.1f} s after the SIGKILL"
        wait_until(lambda: sql(dsn, "select state from pgcoord.job_slots where job = %s"
                                    " and slot_at = %s", job, killed_at_slot)[0][0] != "running",
                   10, "the killed slot's claim was never let go")
        [(state, reason)] = sql(dsn, "select state, reason from pgcoord.job_slots"
                                     " where job = %s and slot_at = %s", job, killed_at_slot)
        assert (state, reason) == ("abandoned", "runner lost")
        skipped = sql(dsn, "select count(*) from pgcoord.job_slots where job = %s and slot_at > %s"
                           " and slot_at < %s + interval '5 seconds' and reason = 'overlap'",
                      job, killed_at_slot, kill_at)
        assert skipped[0][0] <= 2, f"{skipped[0][0]} slots were skipped (overlap) after the kill"
    finally:
        replicas.stop()


# -- the private member: from each pool's own parameters, owned by run() ---------------------


@pytest.mark.parametrize("kind", POOLS)
async def test_the_private_member_is_opened_from_each_pool_and_closed_by_stop(
    dsn: str, kind: str,
) -> None:
    """``Scheduler(source)`` of each driver claims under a member of its own (runner
    ``name/id``, a live row in member_sessions while it runs) opened from the
    source's own connection parameters, and stop() closes it (the row has left)."""
    job = unique(f"own-member-{kind}")
    async with open_pool(kind, dsn) as source:
        s = Scheduler(source)
        ran = asyncio.Event()

        @s.cron(job, "* * * * * *")
        async def work(slot: Slot) -> None:
            ran.set()

        task = asyncio.create_task(s.run())
        await asyncio.wait_for(ran.wait(), 15)
        runner = s.runner
        _, _, member_id = runner.rpartition("/")
        assert member_id.isdigit(), runner
        assert sql(dsn, "select m.\"group\", m.left_at is null from pgcoord.member_sessions as m"
                        " where m.id = %s", int(member_id)) == [("pgcoord.scheduler", True)]
        await s.stop()
        await task
        assert sql(dsn, "select left_at is not null from pgcoord.member_sessions where id = %s",
                   int(member_id)) == [(True,)]
        assert {r for (r,) in sql(dsn, "select runner from pgcoord.job_slots where job = %s"
                                       " and state = 'succeeded'", job)} == {runner}


async def test_a_pool_whose_parameters_no_dsn_holds_runs_untied_and_says_why(
    dsn: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A password given as a function cannot be put in a DSN: the scheduler says so
    once, plainly, and runs its jobs with claims under its plain runner name."""
    job = unique("own-member-refused")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3, password=lambda: "unused")
    try:
        s = Scheduler(pool)
        ran = asyncio.Event()

        @s.cron(job, "* * * * * *")
        async def work(slot: Slot) -> None:
            ran.set()

        task = asyncio.create_task(s.run())
        await asyncio.wait_for(ran.wait(), 15)
        await s.stop()
        await task
        assert "/" not in s.runner
        assert any("no private member" in r.getMessage() and "password=" in r.getMessage()
                   for r in caplog.records)
    finally:
        await pool.close()


@pytest.mark.slow
async def test_a_stop_that_leaves_a_stubborn_run_behind_still_closes_the_private_member(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """A body that swallows every cancellation outlives stop()'s bound; stop() still
    closes the private member, so that the run's claim ends with it instead of
    holding the job on every replica for as long as the process lives."""
    job = unique("stubborn")
    s = Scheduler(pool)
    started = asyncio.Event()
    release = asyncio.Event()

    @s.cron(job, "* * * * * *")
    async def work(slot: Slot) -> None:
        started.set()
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass  # swallowed, again and again

    task = asyncio.create_task(s.run())
    try:
        await asyncio.wait_for(started.wait(), 15)
        _, _, member_id = s.runner.rpartition("/")
        assert member_id.isdigit()
        await asyncio.wait_for(s.stop(drain=0.5), 60)
        assert task.done()
        # A closed session's backend takes a moment to exit (seen in a loaded CI run):
        # gone within 5 s, not at once.
        deadline = time.monotonic() + 5
        while True:
            left = (sql(dsn, "select count(*) from pg_stat_activity where application_name like %s",
                        f"pgcoord-scheduler:{s.runner.rpartition('/')[0]}%"),
                    sql(dsn, "select count(*) from pgcoord.members where id = %s", int(member_id)))
            if left == ([(0,)], [(0,)]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert left == ([(0,)], [(0,)])
    finally:
        release.set()
        await asyncio.gather(task, return_exceptions=True)
