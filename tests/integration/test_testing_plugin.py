"""pgcoord.testing: its fixture gives each test a database with the schema, and its
helpers make elected and locked code face failures, here on the examples' code."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgcoord
from pgcoord import testing

from .conftest import sql

ROOT = Path(__file__).resolve().parents[2]
_seen: list[str] = []


@pytest.mark.parametrize("round_", [1, 2])
def test_each_test_gets_a_database_of_its_own_with_the_schema(pgcoord_dsn: str, dsn: str, round_: int) -> None:
    rows = sql(pgcoord_dsn, "select current_database(), version_num from pgcoord.alembic_version")
    (dbname, version), = rows
    assert [(version,)] == sql(dsn, "select version_num from pgcoord.alembic_version")  # at head
    assert sql(pgcoord_dsn, "select count(*) from pgcoord.leases") == [(0,)]
    sql(pgcoord_dsn, "insert into pgcoord.leases (name, fence) values ('left-over', 1)")
    assert dbname not in _seen  # a fresh one, without the other round's row
    _seen.append(str(dbname))


async def test_take_leadership_makes_the_leader_step_down_and_its_fence_stale(pgcoord_dsn: str) -> None:
    fences: list[int] = []
    stepped_down = asyncio.Event()

    async def lead(fence: int) -> None:
        fences.append(fence)
        try:
            await asyncio.Event().wait()
        finally:
            stepped_down.set()

    elector = pgcoord.Elector(pgcoord_dsn, "duty", ttl=1.0)
    runner = asyncio.create_task(elector.run(lead))
    try:
        await testing.wait_until(lambda: elector.is_leader)
        outsider_fence = await testing.take_leadership(pgcoord_dsn, "duty")
        assert outsider_fence > fences[0]
        with psycopg.connect(pgcoord_dsn) as conn, pytest.raises(pgcoord.StaleFence):
            pgcoord.check_fence(conn, "duty", fences[0])
        await asyncio.wait_for(stepped_down.wait(), 5)
        assert not elector.is_leader and await elector.leader() == testing.OUTSIDER
        await asyncio.sleep(0.5)
        assert len(fences) == 1  # a follower while the outsider holds it
        assert await testing.release_leadership(pgcoord_dsn, "duty")
        await testing.wait_until(lambda: len(fences) == 2)
        assert fences[1] > outsider_fence
    finally:
        await elector.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def test_lose_session_takes_a_holder_s_locks(pgcoord_dsn: str) -> None:
    async with pgcoord.LockHolder(pgcoord_dsn) as holder:
        with pytest.raises(pgcoord.LockLost):
            async with holder.lock("reindex"):
                await testing.lose_session(pgcoord_dsn, holder)
                await asyncio.sleep(5)
        # The holder goes on with a new session.
        async with holder.lock("reindex"):
            pass
    with pytest.raises(TypeError):
        await testing.lose_session(pgcoord_dsn, object())


@pytest.mark.slow
async def test_the_fenced_leader_example_takes_over_from_a_paused_leader(pgcoord_dsn: str) -> None:
    """examples/fenced_leader.py runs as a second replica; this process leads the same
    lease, then pauses past its ttl: the example takes over and writes with a higher
    fence; this process, resumed, finds it no longer leads."""
    name = "example:scheduler"
    ours: list[int] = []

    async def lead(fence: int) -> None:
        ours.append(fence)
        await asyncio.Event().wait()

    elector = pgcoord.Elector(pgcoord_dsn, name, ttl=1.0)
    runner = asyncio.create_task(elector.run(lead))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    example = subprocess.Popen([sys.executable, str(ROOT / "examples" / "fenced_leader.py"), pgcoord_dsn, "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        await testing.wait_until(lambda: elector.is_leader)
        await asyncio.sleep(1.0)  # the example is up, a follower
        testing.pause_past_ttl(elector, factor=1.5)
        await testing.wait_until(lambda: not elector.is_leader, within=3)
        output, _ = await asyncio.to_thread(example.communicate, timeout=30)
        assert example.returncode == 0, output
        theirs = [int(f) for (f,) in sql(pgcoord_dsn, "select distinct fence from example_fenced_writes")]  # type: ignore[misc]
        assert theirs and min(theirs) > ours[0], (ours, theirs, output)
    finally:
        if example.poll() is None:
            example.kill()
        await elector.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await runner


async def test_run_slot_runs_a_given_slot_once_as_the_scheduler_would(pgcoord_dsn: str) -> None:
    import datetime as dt

    import asyncpg

    pool = await asyncpg.create_pool(pgcoord_dsn, min_size=1, max_size=3)
    try:
        sched = pgcoord.Scheduler(pool)
        seen: list[tuple[dt.datetime, bool]] = []

        @sched.cron("report", "0 3 * * *", tz="Europe/Paris")
        async def report(slot: pgcoord.Slot) -> None:
            seen.append((slot.at, slot.manual))

        at = dt.datetime(2026, 10, 25, 2, 0, tzinfo=dt.UTC)  # 03:00 in Paris, the day DST ends
        slot = await testing.run_slot(sched, "report", at)
        assert slot.at == at and [s for s, _m in seen] == [at]
        state = await pool.fetchval("select state from pgcoord.job_slots where job = 'report' and slot_at = $1", at)
        assert state == "succeeded"
        with pytest.raises(ValueError, match="already has a row"):
            await testing.run_slot(sched, "report", at)  # once
        with pytest.raises(ValueError):
            await testing.run_slot(sched, "report", at + dt.timedelta(minutes=1))  # not an instant
        assert len(seen) == 1
    finally:
        await pool.close()


def test_the_plugin_loads_by_its_entry_point_in_a_project_of_its_own(pg_server: Any, tmp_path: Path) -> None:
    """A user's project: no conftest, nothing imported by hand. pytest finds the
    fixture through the entry point, and PGCOORD_TEST_DSN points it at a server."""
    (tmp_path / "test_user.py").write_text(
        "def test_uses_the_fixture(pgcoord_dsn):\n"
        "    import psycopg\n"
        "    with psycopg.connect(pgcoord_dsn) as conn:\n"
        "        assert conn.execute('select count(*) from pgcoord.leases').fetchone() == (0,)\n"
        "    import sys\n"
        "    assert 'pgcoord_pytest' in sys.modules\n")
    env = {**os.environ, "PGCOORD_TEST_DSN": pg_server.dsn("postgres")}
    env.pop("PYTEST_ADDOPTS", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_user.py"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_loading_the_plugin_imports_nothing_of_pgcoord() -> None:
    code = ("import sys, pgcoord_pytest; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pgcoord', 'psycopg', 'asyncpg', 'sqlalchemy', 'pytest_postgresql')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


async def test_advance_moves_a_scheduler_to_an_instant_as_a_jump_in_time_would(pgcoord_dsn: str) -> None:
    import datetime as dt

    import asyncpg

    pool = await asyncpg.create_pool(pgcoord_dsn, min_size=1, max_size=3)
    try:
        sched = pgcoord.Scheduler(pool)
        seen: list[dt.datetime] = []

        @sched.cron("nightly", "30 2 * * *", tz="Europe/Berlin")  # catch_up="latest" by default
        async def nightly(slot: pgcoord.Slot) -> None:
            seen.append(slot.at)

        now = await pool.fetchval("select now()")
        # Declares the job (it counts from now) and ticks a second ahead: nothing is due.
        assert await testing.advance(sched, now + dt.timedelta(seconds=1)) == []
        later = now + dt.timedelta(days=3)
        ran = await testing.advance(sched, later)
        # Three nights came due in the jump: the latest ran (catch_up="latest"), the
        # earlier ones were recorded missed, as after a real outage of three days.
        assert [s.at for s in ran] == seen and len(seen) == 1
        assert seen[0] <= later and later - seen[0] < dt.timedelta(days=1)
        states = await pool.fetch("select state, count(*) from pgcoord.job_slots where job = 'nightly'"
                                  " group by state order by state")
        assert [(r["state"], r["count"]) for r in states] == [("missed", 2), ("succeeded", 1)]
        with pytest.raises(ValueError, match="does not go back"):
            await testing.advance(sched, now)
    finally:
        await pool.close()
