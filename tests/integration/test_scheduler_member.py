"""A Scheduler with a Member: a dead runner's claims are freed at once, not after
claim_ttl, so the slots after a crash are neither skipped nor delayed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

import pgcoord

from .conftest import sql

REPLICA = str(Path(__file__).with_name("scheduler_replica.py"))


def spawn(dsn: str, job: str, mode: str, label: str, claim_ttl: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, REPLICA, dsn, job, mode, label, "member", str(claim_ttl)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def slots(dsn: str, job: str) -> list[tuple[object, ...]]:
    return sql(dsn, "select slot_at, state, reason, attempt, runner, finished_at"
                    " from pgcoord.job_slots where job = %s order by slot_at", job)


def wait_for(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def tables(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table if not exists job_starts (id serial primary key, job text,"
                     " slot_at timestamptz, attempt int, runner text)")
        conn.execute("create table if not exists job_effects (job text, slot_at timestamptz,"
                     " primary key (job, slot_at))")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", "retry"])
def test_a_killed_runner_s_slot_is_settled_at_once_and_no_later_slot_is_skipped(
    dsn: str, tables: None, mode: str,
) -> None:
    # claim_ttl 30 s: without the member, the killed slot would stay running for
    # 30 s and every slot due meanwhile would be skipped as an overlap.
    job = f"member-sched:{mode}:{uuid.uuid4().hex[:6]}"
    procs = {label: spawn(dsn, job, mode, label, 30.0) for label in ("a", "b")}
    try:
        running: list[tuple[object, ...]] = []

        def a_slot_runs() -> bool:
            running[:] = sql(dsn, "select slot_at, runner from pgcoord.job_slots"
                                  " where job = %s and state = 'running'", job)
            return bool(running)

        wait_for(a_slot_runs, 30)
        slot_at, runner = running[0]
        victim = str(runner).split("/")[0]
        procs[victim].kill()
        killed = time.time()
        # The killed slot is settled within a second (not 30 s)...
        def settled() -> bool:
            rows = sql(dsn, "select state, attempt from pgcoord.job_slots where job = %s and slot_at = %s",
                       job, slot_at)
            if mode == "skip":
                return rows[0][0] == "abandoned"
            return rows[0][1] == 2 or rows[0][0] == "succeeded" and rows[0][1] == 2  # type: ignore[comparison-overlap]
        wait_for(settled, 5)
        assert time.time() - killed < 3.0
        # ...and the slots due after it run on the survivor, none skipped as an overlap.
        time.sleep(3.5)
        after = [r for r in slots(dsn, job) if r[0] > slot_at]  # type: ignore[operator]
        assert len(after) >= 3
        assert [r for r in after if r[1] == "skipped"] == []
        assert all(r[1] in ("succeeded", "running") for r in after), after
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def test_a_runner_whose_member_session_ends_stops_its_body(dsn: str) -> None:
    import asyncio

    import asyncpg

    job = f"member-sched:lost:{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    started, cancelled = asyncio.Event(), asyncio.Event()
    try:
        async with pgcoord.Member(dsn, group="sched-lost", ttl=30) as member:
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(job, "* * * * * *", claim_ttl=30, on_crash="retry")
            async def work(slot: pgcoord.Slot) -> None:
                started.set()
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise

            runner = asyncio.create_task(sched.run())
            await asyncio.wait_for(started.wait(), 10)
            old_id = member.id
            assert member._main is not None
            sql(dsn, "select pg_terminate_backend(%s)", member._main.backend_pid)
            # The claim was tied to that session: the body stops at once...
            await asyncio.wait_for(cancelled.wait(), 3)
            # ...and the claim (expired by the member's death) is retried under the
            # member's new incarnation.
            async with asyncio.timeout(10):
                while True:
                    rows = sql(dsn, "select runner, attempt from pgcoord.job_slots"
                                    " where job = %s and attempt = 2", job)
                    if rows:
                        break
                    await asyncio.sleep(0.05)
            assert rows[0][0] != f"{member.name}/{old_id}"
            await sched.stop(drain=0)
            await runner
    finally:
        await pool.close()
