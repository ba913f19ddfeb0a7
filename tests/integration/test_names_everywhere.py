"""Names everywhere (issue 24): every lock pgcoord.holders shows carries its name, in
the view and in ``pgcoord status`` (table and JSON), whatever took it: a LockHolder's
lock by name (held, and waited for), its semaphore, the same on a Member, a member's
alive lock, an elector's doorbell and its followers' candidacy lock, partitions'
parts and participation, a transactional job's lock. Nothing is left held after."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator

import asyncpg
import pytest

import pgcoord
from pgcoord.cli.main import main as cli_main

from .conftest import advisory_locks, sql, unique


def held_names(dsn: str) -> list[tuple[str, str | None, bool]]:
    """(kind, name, granted) of every row of pgcoord.holders but leases and jobs."""
    return [(str(k), n, bool(g)) for k, n, g in sql(  # type: ignore[misc]
        dsn, "select kind, name, granted from pgcoord.holders where kind in ('advisory', 'semaphore')"
             " and pid <> pg_backend_pid() order by kind, name")]


def status(dsn: str, *args: str) -> str:
    """``pgcoord status``'s output, on a terminal of 120 columns (its widest table)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), _columns(120):
        assert cli_main(["status", "--dsn", dsn, *args]) == 0
    return out.getvalue()


@contextlib.contextmanager
def _columns(n: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def assert_named(dsn: str, expected: list[tuple[str, str, bool]]) -> None:
    """Each expected (kind, name, granted) is in the view, in the status table and in
    its JSON; and no advisory or semaphore row of the view is unnamed."""
    rows = held_names(dsn)
    for row in expected:
        assert row in rows, (row, rows)
    assert [r for r in rows if r[1] is None] == [], rows
    table = status(dsn)
    doc = json.loads(status(dsn, "--json"))
    for kind, name, _ in expected:
        assert name in table, (name, table)
        assert any(d["kind"] == kind and d["name"] == name for d in doc), (name, doc)
    assert all(d["name"] is not None for d in doc), doc


async def wait_until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    yield p
    await p.close()


async def test_a_lock_holders_lock_by_name_is_named_held_and_waited_for(dsn: str) -> None:
    name = unique("reindex-orders")
    async with pgcoord.LockHolder(dsn) as holder, pgcoord.LockHolder(dsn) as other:
        async with holder.lock(name):
            waiter = asyncio.create_task(other.lock(name, timeout=30).__aenter__())
            await wait_until(lambda: (("advisory", name, False) in held_names(dsn)))
            assert_named(dsn, [("advisory", name, True), ("advisory", name, False)])
        held = await waiter
        await held.__aexit__(None, None, None)
    assert sql(dsn, "select name from pgcoord.lock_names where key = pgcoord.lock_key(%s)", name) == [
        (name,)]
    assert advisory_locks(dsn) == []


async def test_a_lock_holder_on_a_pool_names_its_locks_and_semaphores(
        dsn: str, pool: asyncpg.Pool) -> None:
    lock, sem = unique("pool-lock"), unique("pool-sem")
    async with pgcoord.LockHolder(pool) as holder:
        async with holder.lock(lock), holder.semaphore(sem, limit=2):
            assert_named(dsn, [("advisory", lock, True), ("semaphore", sem, True)])
    assert advisory_locks(dsn) == []


async def test_a_members_locks_semaphores_alive_lock_elector_and_candidates_are_named(
        dsn: str) -> None:
    group, lock, sem, election = unique("g"), unique("m-lock"), unique("m-sem"), unique("boss")
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.Event().wait()

    async with pgcoord.Member(dsn, group=group, name="first") as first, \
            pgcoord.Member(dsn, group=group, name="second") as second:
        async with pgcoord.LockHolder(first) as holder, holder.lock(lock), \
                holder.semaphore(sem, limit=3):
            leader = asyncio.create_task(pgcoord.Elector(first, election, ttl=10.0).run(lead))
            await asyncio.wait_for(led.wait(), 20)
            follower = asyncio.create_task(pgcoord.Elector(second, election, ttl=10.0).run(lead))
            try:
                await wait_until(lambda: ("advisory", f"pgcoord.candidate:{election}", True)
                                 in held_names(dsn))
                assert_named(dsn, [
                    ("advisory", lock, True), ("semaphore", sem, True),
                    ("advisory", f"pgcoord.member:{group}/first", True),
                    ("advisory", f"pgcoord.member:{group}/second", True),
                    ("advisory", f"pgcoord.elector:{election}", True),
                    ("advisory", f"pgcoord.candidate:{election}", True),
                ])
                # The member column says whose session holds what.
                assert sql(dsn, "select member from pgcoord.holders where name = %s", lock) == [
                    ("first",)]
            finally:
                for task in (leader, follower):
                    task.cancel()
                await asyncio.gather(leader, follower, return_exceptions=True)
    assert advisory_locks(dsn) == []


async def test_an_elector_on_its_own_session_names_its_doorbell(dsn: str) -> None:
    election = unique("solo")
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(pgcoord.Elector(dsn, election, ttl=10.0).run(lead))
    try:
        await asyncio.wait_for(led.wait(), 20)
        assert_named(dsn, [("advisory", f"pgcoord.elector:{election}", True)])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert advisory_locks(dsn) == []


async def test_partitions_name_their_parts_and_the_participation(dsn: str) -> None:
    name = unique("ingest")
    async with pgcoord.Member(dsn, group=unique("g")) as member:
        parts = pgcoord.Partitions(member, name, count=2)
        owned: set[int] = set()

        async def own(part: pgcoord.Partition) -> None:
            owned.add(part.index)
            await asyncio.Event().wait()

        task = asyncio.create_task(parts.run(own))
        try:
            await wait_until(lambda: owned == {0, 1})
            [(member_id,)] = sql(dsn, "select id from pgcoord.members where pid = %s",
                                 sql(dsn, "select pid from pgcoord.holders where kind = 'lease'"
                                          " and name = %s", f"{name}/0")[0][0])
            assert_named(dsn, [
                ("advisory", f"pgcoord.elector:{name}/0", True),
                ("advisory", f"pgcoord.elector:{name}/1", True),
                ("advisory", f"pgcoord.partitions:{name}:{member_id}", True),
            ])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert advisory_locks(dsn) == []
    # The participation's name goes with the member's row (deleted a minute after it
    # left, or at once here), so that lock_names does not grow with every process.
    sql(dsn, "delete from pgcoord.member_sessions where id = %s", member_id)
    assert sql(dsn, "select count(*) from pgcoord.lock_names where name = %s",
               f"pgcoord.partitions:{name}:{member_id}") == [(0,)]


async def test_a_transactional_jobs_lock_is_named_after_its_slot(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("nightly")
    sched = pgcoord.Scheduler(pool)
    checked: list[pgcoord.Slot] = []

    @sched.cron(job, "0 0 1 1 *", transactional=True)
    async def nightly(slot: pgcoord.Slot) -> None:
        assert slot.conn is not None
        await slot.conn.execute("select 1")  # the slot's lock is taken with the first statement
        # Looked at from other sessions while the run holds it.
        await asyncio.to_thread(assert_named, dsn, [("advisory", f"pgcoord.job:{slot.key}", True)])
        checked.append(slot)

    task = asyncio.create_task(sched.run())
    try:
        await wait_until(lambda: bool(sql(dsn, "select 1 from pgcoord.schedules where name = %s", job)))
        await sched.trigger(job)
        await wait_until(lambda: bool(checked))
        await wait_until(lambda: sql(dsn, "select state from pgcoord.job_slots where job = %s", job)
                         == [("succeeded",)])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert advisory_locks(dsn) == []


def test_a_numeric_key_stays_a_number(dsn: str) -> None:
    """Only names are shown: a key taken as a number has none, and status shows #key."""
    with __import__("psycopg").connect(dsn, autocommit=True) as conn:
        conn.execute("select pg_advisory_lock(424242)")
        try:
            assert ("advisory", None, True) in held_names(dsn)
            assert "#424242" in status(dsn)
        finally:
            conn.execute("select pg_advisory_unlock(424242)")


async def test_names_are_remembered_per_process_within_a_bound(
    dsn: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Locks taken per entity (a name per order) record each name, but the process
    remembers only the most recent ones: memory stays bounded, and a name it forgot
    is recorded again on its next use (a duplicate row is never made)."""
    from pgcoord.locks import advisory

    monkeypatch.setattr(advisory.recorded_names, "capacity", 3)
    names = [unique("order") for _ in range(8)]
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        for name in [*names, names[0]]:
            async with pgcoord.exclusive(pool, name):
                pass
        async with pgcoord.LockHolder(pool) as holder, holder.lock(names[1]):
            pass
    finally:
        await pool.close()
    assert len(advisory.recorded_names) == 3
    assert pgcoord.lock_key(names[0]) in advisory.recorded_names
    assert sorted(r[0] for r in sql(dsn, "select name from pgcoord.lock_names where name = any(%s)",
                                    names)) == sorted(names)
