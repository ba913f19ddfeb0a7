"""Schedules at runtime with real replica processes (docs/schedules.md): handlers that
only some replicas have, changes while replicas run, and a replica SIGKILLed in
the middle of applying changes."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from pgcoord.scheduler import Scheduler

from .conftest import sql, unique

REPLICA = str(Path(__file__).with_name("schedules_replica.py"))
ROOT = Path(__file__).resolve().parents[2]


class Fleet:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.procs: list[subprocess.Popen[str]] = []
        sql(dsn, "create table if not exists sched_runs (job text, slot_at timestamptz,"
                 " manual boolean, args text, runner text)")

    def spawn(self, label: str, handlers: list[str], *extra: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, REPLICA, self.dsn, label, ",".join(handlers), *extra],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
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


@pytest.fixture
def fleet(dsn: str) -> Iterator[Fleet]:
    f = Fleet(dsn)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    yield p
    await p.close()


def starts(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, runner, args from sched_runs where job = %s and not manual"
                    " order by slot_at", job)


def slot_rows(dsn: str, job: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select slot_at, state, reason, runner from pgcoord.job_slots"
                    " where job = %s and not manual order by slot_at", job)


def seconds_of(rows: list[tuple[Any, ...]]) -> list[int]:
    return [int(r[0].timestamp()) for r in rows]


def db_now(dsn: str) -> dt.datetime:
    value = sql(dsn, "select clock_timestamp()")[0][0]
    assert isinstance(value, dt.datetime)
    return value


async def test_a_replica_without_the_handler_never_claims_its_slots(
        dsn: str, fleet: Fleet, pool: asyncpg.Pool) -> None:
    common, only_b = unique("common"), unique("only-b")
    fleet.spawn("a", [common])
    fleet.spawn("b", [common, only_b])
    admin = Scheduler(pool)
    shared, special = unique("shared"), unique("special")
    await admin.add(shared, "* * * * * *", handler=common)
    await admin.add(special, "* * * * * *", handler=only_b)
    await asyncio.sleep(3.5)
    fleet.stop()
    special_rows = slot_rows(dsn, special)
    assert len(special_rows) >= 3 and {r[3] for r in special_rows} == {"b"}
    assert {r[1] for r in special_rows} == {"succeeded"}
    shared_starts = starts(dsn, shared)
    assert len(shared_starts) >= 3
    assert len({r[0] for r in shared_starts}) == len(shared_starts)  # each slot started once
    assert seconds_of(slot_rows(dsn, shared)) == list(range(
        seconds_of(slot_rows(dsn, shared))[0], seconds_of(slot_rows(dsn, shared))[-1] + 1))


async def test_changes_while_replicas_run_keep_exactly_once_and_a_row_per_slot(
        dsn: str, fleet: Fleet, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("changing")
    # Besides the shared schedule, one that only each replica runs: whether each
    # replica applied the change within a second does not depend on who wins a race.
    h_poll, h_listen = unique("h-poll"), unique("h-listen")
    fleet.spawn("polling", [handler, h_poll])                # sees changes through the tick's counter
    fleet.spawn("listening", [handler, h_listen], "member")  # and through NOTIFY on a member's session
    admin = Scheduler(pool)
    own = {"polling": unique("own-poll"), "listening": unique("own-listen")}
    await admin.add(own["polling"], "* * * * * *", handler=h_poll, args={"phase": 1})
    await admin.add(own["listening"], "* * * * * *", handler=h_listen, args={"phase": 1})
    await admin.add(name, "* * * * * *", handler=handler, args={"phase": 1})
    await asyncio.sleep(2.2)
    await admin.update(name, expr="*/2 * * * * *", args={"phase": 2})
    changed = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    own_changed = {}
    for label, own_name in own.items():
        await admin.update(own_name, expr="*/2 * * * * *", args={"phase": 2})
        own_changed[label] = sql(dsn, "select since from pgcoord.schedules where name = %s",
                                 own_name)[0][0]
    await asyncio.sleep(2.5)
    await admin.pause(name)
    paused = sql(dsn, "select paused_at from pgcoord.schedules where name = %s", name)[0][0]
    await asyncio.sleep(2.5)
    await admin.resume(name)
    resumed = sql(dsn, "select resumed_at from pgcoord.schedules where name = %s", name)[0][0]
    await asyncio.sleep(2.5)
    await admin.remove(name)
    removed = db_now(dsn)
    await asyncio.sleep(1.5)
    fleet.stop()

    found = slot_rows(dsn, name)
    ran = starts(dsn, name)
    assert len({r[0] for r in ran}) == len(ran), "a slot started twice"
    assert ran and {r[1] for r in ran} <= {"polling", "listening"}
    # Before the change: every second has a row; after it, every even second.
    old = [r for r in found if r[0] <= changed]
    assert seconds_of(old) == list(range(seconds_of(old)[0], seconds_of(old)[-1] + 1))
    new = [r for r in found if r[0] > changed]
    assert all(s % 2 == 0 for s in seconds_of(new))
    assert seconds_of(new) == list(range(seconds_of(new)[0], seconds_of(new)[-1] + 1, 2))
    first_new = next(r for r in ran if r[0] > changed)
    assert '"phase": 2' in first_new[2]
    # Each replica applied the change within a second (docs/schedules.md): its first slot
    # of the new expression started at most 1 s after it was due or after the
    # change, whichever is later (plus 0.3 s for a loaded host).
    for label, own_name in own.items():
        since = own_changed[label]
        first = sql(dsn, "select slot_at, started_at, runner from pgcoord.job_slots"
                         " where job = %s and slot_at > %s and not manual order by slot_at limit 1",
                    own_name, since)
        assert first and first[0][2].split("/")[0] == label
        slot_at, started_at, _ = first[0]
        late = (started_at - max(slot_at, since)).total_seconds()
        assert late < 1.3, f"{label} applied the change {late:.2f} s late"
        assert all('"phase": 2' in r[2] for r in starts(dsn, own_name) if r[0] > since)
    # Paused: skipped rows and no start; resumed: runs again; removed: nothing after.
    in_pause = [r for r in found if paused < r[0] <= resumed]
    assert in_pause and {(r[1], r[2]) for r in in_pause} == {("skipped", "paused")}
    assert not [r for r in ran if paused < r[0] <= resumed]
    assert [r for r in found if resumed < r[0] <= removed and r[1] == "succeeded"]
    assert not [r for r in found if r[0] > removed]
    assert {r[1] for r in found} <= {"succeeded", "skipped"}


async def test_a_replica_killed_while_applying_changes_leaves_a_whole_schedule(
        dsn: str, fleet: Fleet, pool: asyncpg.Pool) -> None:
    handler, name = unique("h"), unique("churned")
    admin = Scheduler(pool)
    await admin.add(name, "* * * * * *", handler=handler)
    fleet.spawn("survivor", [handler])
    churner = fleet.spawn("churner", [handler], "churn", name)
    assert churner.stdout is not None
    # Let it change the schedule many times, and kill it in the middle of one.
    for _ in range(40):
        line = churner.stdout.readline()
    assert line.startswith("CHANGE")
    churner.send_signal(signal.SIGKILL)
    churner.wait(10)
    killed = db_now(dsn)
    before = sql(dsn, "select version, expr, paused from pgcoord.schedules where name = %s", name)
    assert before and before[0][0] > 10
    paused = before[0][2]
    if paused:  # killed between its pause and its resume
        await admin.resume(name)
    await admin.update(name, expr="* * * * * *")
    after_change = sql(dsn, "select since from pgcoord.schedules where name = %s", name)[0][0]
    await asyncio.sleep(4.5)
    fleet.stop()
    ran = starts(dsn, name)
    assert len({r[0] for r in ran}) == len(ran), "a slot started twice"
    # The survivor went on alone: every second after the last change ran, except that
    # a slot due before a run the churner was killed in was found dead is skipped for
    # overlap (docs/scheduler.md: a retry must not run beside the next slot). It is
    # found once its claim has expired (claim_ttl 1 s, and without a member nobody can
    # tell sooner), at the survivor's next look for lost claims (every claim_ttl/3; a
    # second allowed here, for a loaded host: CI saw one come after the next slot).
    later = [r for r in slot_rows(dsn, name) if r[0] > after_change]
    found_dead = killed + dt.timedelta(seconds=2.0)
    assert all(r[1:3] == ("skipped", "overlap") for r in later
               if r[1] != "succeeded" and r[0] <= found_dead)
    later = [r for r in later if r[0] > found_dead]
    assert len(later) >= 2 and {r[1] for r in later} == {"succeeded"}
    assert {r[3] for r in later} == {"survivor"}
    assert seconds_of(later) == list(range(seconds_of(later)[0], seconds_of(later)[-1] + 1))
    # No slot of the churn is left running, and none is later than the kill but not done.
    assert not sql(dsn, "select 1 from pgcoord.job_slots where job = %s and state = 'running'", name)
    assert killed < later[0][0] + dt.timedelta(seconds=60)


async def test_a_runner_killed_after_its_schedule_was_removed_leaves_no_slot_running(
        dsn: str, fleet: Fleet, pool: asyncpg.Pool) -> None:
    """Recovery looked only at the schedules a replica runs: a removed schedule's
    slot, or one whose handler only the dead replica had, stayed running for ever."""
    mine, other = unique("mine"), unique("other")
    doomed = fleet.spawn("doomed", [mine])
    fleet.spawn("survivor", [other])
    admin = Scheduler(pool)
    removed, orphan, alive = unique("removed"), unique("orphan"), unique("alive")
    await admin.add(alive, "* * * * * *", handler=other)
    await admin.add(removed, "* * * * * *", handler=mine, args={"sleep": 60})
    await admin.add(orphan, "* * * * * *", handler=mine, args={"sleep": 60})
    deadline = asyncio.get_running_loop().time() + 10
    while not (starts(dsn, removed) and starts(dsn, orphan)):
        assert asyncio.get_running_loop().time() < deadline, "the slots did not start"
        await asyncio.sleep(0.05)
    await admin.remove(removed)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    deadline = asyncio.get_running_loop().time() + 10
    while sql(dsn, "select 1 from pgcoord.job_slots where job in (%s, %s) and state = 'running'",
              removed, orphan):
        assert asyncio.get_running_loop().time() < deadline, "a dead runner's slot is still running"
        await asyncio.sleep(0.1)
    lost = sql(dsn, "select job, reason from pgcoord.job_slots where job in (%s, %s)"
                    " and state = 'abandoned' order by job", removed, orphan)
    assert (removed, "runner lost; schedule removed") in lost
    assert (orphan, "runner lost") in lost
