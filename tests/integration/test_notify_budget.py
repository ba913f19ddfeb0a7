"""pgcoord's own NOTIFYs: none that nobody hears, and the needed ones still come.

Before PostgreSQL 19 every NOTIFY signals every listening session of the database
and serializes commits on a database-wide lock, whoever listens. So lease, member
and schedule news is told only when a session registered as its listener
(``pgcoord.ears_open``, migration 0010). Each test counts what the server really
sends with a spy that listens *without* registering (notify_spy.py), in a database
of its own so that no other test's members are heard.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.migrations

from .conftest import Server, migrated_database
from .notify_spy import NotifySpy

EARS_NS = 1885823854


@pytest.fixture(scope="module")
def db(pg_server: Server) -> Iterator[str]:
    yield from migrated_database(pg_server, "pgcoord_budget")


@pytest.fixture
async def pool(db: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(db, min_size=1, max_size=4)
    try:
        yield p
    finally:
        await p.close()


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def registered(dsn: str, channel_code: int) -> list[int]:
    """The pids registered as listeners of a channel (1 leases, 2 members)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(r[0] for r in conn.execute(
            "select pid from pg_locks where locktype = 'advisory' and granted and objsubid = 2"
            " and classid = %s and objid = %s and mode = 'ShareLock'",
            (EARS_NS, channel_code)).fetchall())


async def until(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


class Ears:
    """A plain session registered as a listener of a channel, as pgcoord's are."""

    def __init__(self, dsn: str, channel: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("select pgcoord.ears_open(%s)", (channel,))
        self.conn.execute(f'LISTEN "{channel}"')

    def heard(self, quiet: float = 0.3) -> list[str]:
        return [n.payload for n in self.conn.notifies(timeout=quiet)]

    def close(self) -> None:
        self.conn.close()


# -- leases ---------------------------------------------------------------------------------


async def test_a_lease_acquired_renewed_and_released_tells_nobody_when_nobody_listens(
        db: str, pool: asyncpg.Pool) -> None:
    with NotifySpy(db) as spy:
        lease = pgcoord.Lease(pool, name("lease"), ttl=1.5)
        await lease.acquire()
        assert spy.take() == {}, "acquire"
        await asyncio.sleep(1.3)  # two renewals (every ttl/3)
        assert spy.take() == {}, "renewals"
        await lease.release()
        assert spy.take() == {}, "release"


async def test_a_registered_listener_hears_acquire_and_release_but_no_renewal(
        db: str, pool: asyncpg.Pool) -> None:
    ears = Ears(db, "pgcoord_leases")
    try:
        with NotifySpy(db) as spy:
            lease = pgcoord.Lease(pool, name("lease"), ttl=1.5)
            await lease.acquire()
            assert spy.take() == {"pgcoord_leases": 1}
            await asyncio.sleep(1.3)
            assert spy.take() == {}, "a renewal tells nothing"
            await lease.release()
            assert spy.take() == {"pgcoord_leases": 1}
            # A takeover of the row is told once (an upsert fired the BEFORE INSERT
            # trigger too, which told a proposed row with the old fence).
            again = pgcoord.Lease(pool, lease.name, ttl=1.5)
            await again.acquire()
            assert spy.take() == {"pgcoord_leases": 1}
            await again.release()
            spy.take()
        assert len(ears.heard()) == 4
    finally:
        ears.close()
    # Gone with its session: nobody is told any more.
    await until(lambda: registered(db, 1) == [], 5)
    with NotifySpy(db) as spy:
        lease = pgcoord.Lease(pool, name("lease"), ttl=5)
        await lease.acquire()
        await lease.release()
        assert spy.take() == {}


async def test_a_plain_elector_term_tells_nobody_when_nobody_watches(db: str) -> None:
    election = name("election")
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.sleep(3600)

    with NotifySpy(db) as spy:
        a, b = (pgcoord.Elector(db, election, ttl=1.5, holder=h) for h in ("a", "b"))
        runs = [asyncio.create_task(e.run(lead)) for e in (a, b)]
        try:
            await asyncio.wait_for(led.wait(), 10)
            await asyncio.sleep(1.3)  # renewals
            leader, follower = (a, b) if a.is_leader else (b, a)
            await leader.stop()
            await until(lambda: follower.is_leader, 5)
            await follower.stop()
            # Two terms: acquired, renewed, released, taken over, released.
            assert spy.take() == {}
        finally:
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)


async def test_a_resign_request_still_reaches_a_plain_leader_at_once(db: str) -> None:
    """The leader listens while it leads: request_resign() is told, and heard."""
    election = name("election")
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.sleep(3600)

    elector = pgcoord.Elector(db, election, ttl=30.0)
    run = asyncio.create_task(elector.run(lead))
    try:
        await asyncio.wait_for(led.wait(), 10)
        await until(lambda: elector._heard is not None, 5)  # its LISTEN is in place
        assert registered(db, 1) != []
        with NotifySpy(db) as spy:
            asked = time.monotonic()
            with psycopg.connect(db, autocommit=True) as conn:
                assert conn.execute("select pgcoord.request_resign(%s)", (election,)).fetchone() == (True,)
            await until(lambda: not elector.is_leader, 2)  # a renewal would take 10 s
            assert time.monotonic() - asked < 2
            assert spy.take()["pgcoord_leases"] >= 1
    finally:
        await elector.stop()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


# -- members --------------------------------------------------------------------------------


async def test_members_joining_heartbeating_and_leaving_tell_nobody_when_nobody_listens(db: str) -> None:
    g = name("g")
    async with pgcoord.Member(db, group=g, ttl=1.5) as a, pgcoord.Member(db, group=g, ttl=1.5) as b:
        # Each has a successor in the ring: neither listens.
        await until(lambda: not a._listening and not b._listening, 5)
        await until(lambda: registered(db, 2) == [], 5)
        with NotifySpy(db) as spy:
            c = pgcoord.Member(db, group=g, ttl=1.5)
            await c.__aenter__()
            assert spy.take() == {}, "join"
            await asyncio.sleep(1.2)  # heartbeats, every ttl/3
            assert spy.take() == {}, "heartbeats"
            await c.close()
            assert spy.take() == {}, "leave"
            d = pgcoord.Member(db, group=g, ttl=1.5)
            await d.__aenter__()
            spy.take()
            pid = d._main.backend_pid  # type: ignore[union-attr]
            with psycopg.connect(db, autocommit=True) as conn:
                conn.execute("select pg_terminate_backend(%s)", (pid,))
            await until(lambda: d.id not in {p.id for p in a._view.values()}, 5)
            assert spy.take() == {}, "a crash, reaped by the watcher"
            await d.close()


async def test_crash_news_still_reaches_a_watcher_fast(db: str) -> None:
    g = name("g")
    async with pgcoord.Member(db, group=g, ttl=30.0) as a, pgcoord.Member(db, group=g, ttl=30.0) as b:
        changes = a.watch()

        async def first_departure() -> pgcoord.MemberLeft:
            async for change in changes:
                if isinstance(change, pgcoord.MemberLeft):
                    return change
            raise AssertionError("the watch ended")

        left = asyncio.ensure_future(first_departure())
        await until(lambda: "pgcoord_members" in a._listening, 5)
        pid, b_id = b._main.backend_pid, b.id  # type: ignore[union-attr]
        killed = time.monotonic()
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(%s)", (pid,))
        change = await asyncio.wait_for(left, 5)
        assert time.monotonic() - killed < 2.0
        assert change.member.id == b_id and change.reason == "crashed"
        changes.close()


PROCESS = """
import asyncio, sys
import pgcoord

async def main(dsn, group):
    members = [pgcoord.Member(dsn, group=group, ttl=30.0) for _ in range(3)]
    await asyncio.gather(*(m.open() for m in members))
    print("JOINED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_members_dying_together_are_told_in_one_notify(db: str) -> None:
    """A process that takes three members with it: the watcher that finds them reaps
    them in one statement, and tells them in one NOTIFY (each listening session is
    signalled once, not once per death)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    g = name("g")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", PROCESS, db, g], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "JOINED"
        async with pgcoord.Member(db, group=g, ttl=30.0) as a:
            changes = a.watch()
            left: list[pgcoord.MemberLeft] = []

            async def collect() -> None:
                async for change in changes:
                    if isinstance(change, pgcoord.MemberLeft):
                        left.append(change)

            collecting = asyncio.create_task(collect())
            await until(lambda: "pgcoord_members" in a._listening and len(a._view) == 4, 10)
            with NotifySpy(db) as spy:
                proc.send_signal(signal.SIGKILL)
                await until(lambda: len(left) == 3, 5)
                assert {c.reason for c in left} == {"crashed"}
                # The three backends of the killed process end one by one, so the
                # watcher may find them in two reaps (seen once in a loaded run); one
                # NOTIFY per death, as before 0010, would be three.
                told = spy.take()
                assert set(told) == {"pgcoord_members"} and told["pgcoord_members"] < 3, told
            collecting.cancel()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# -- schedules and semaphores -----------------------------------------------------------------


async def test_a_schedule_change_tells_nobody_when_nobody_listens_but_moves_the_counter(
        db: str, pool: asyncpg.Pool) -> None:
    sched = pgcoord.Scheduler(pool)
    with psycopg.connect(db, autocommit=True) as conn:
        before = conn.execute("select epoch from pgcoord.schedule_epoch").fetchone()
    with NotifySpy(db) as spy:
        await sched.add(name("job"), "0 0 1 1 *", handler=name("h"))
        assert spy.take() == {}
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("select epoch from pgcoord.schedule_epoch").fetchone() != before
    ears = Ears(db, "pgcoord_schedules")
    try:
        with NotifySpy(db) as spy:
            await sched.add(name("job"), "0 0 1 1 *", handler=name("h"))
            assert spy.take() == {"pgcoord_schedules": 1}
    finally:
        ears.close()


async def test_a_semaphore_taken_and_released_by_pgcoord_tells_nobody_without_waiters(
        db: str, pool: asyncpg.Pool) -> None:
    with NotifySpy(db) as spy:
        async with pgcoord.semaphore(pool, name("sem"), limit=2):
            pass
        assert spy.take() == {}


# -- the register ---------------------------------------------------------------------------


def test_a_listener_registering_waits_for_a_teller_that_found_nobody(db: str) -> None:
    """A teller that found nobody listening holds the gate until it commits: a
    listener that registers meanwhile waits, and so looks only after the change is
    committed (or at most 200 ms: a change held open longer is left to its fallback)."""
    with psycopg.connect(db) as teller:
        told = teller.execute("select pgcoord.notify_heard('pgcoord_leases', 'x')").fetchone()
        assert told == (False,)
        done: list[float] = []

        def register() -> None:
            with psycopg.connect(db, autocommit=True) as conn:
                started = time.monotonic()
                conn.execute("select pgcoord.ears_open('pgcoord_leases')")
                done.append(time.monotonic() - started)

        thread = threading.Thread(target=register)
        thread.start()
        time.sleep(0.1)
        assert done == []  # waiting for the teller's commit
        teller.commit()
        thread.join(5)
        assert done and 0.08 < done[0] < 0.5
    # A teller held open past the bound does not stall a listener for long.
    with psycopg.connect(db) as teller:
        teller.execute("select pgcoord.notify_heard('pgcoord_leases', 'x')")
        with psycopg.connect(db, autocommit=True) as conn:
            started = time.monotonic()
            conn.execute("select pgcoord.ears_open('pgcoord_leases')")
            assert time.monotonic() - started < 1.0
            assert conn.execute("show lock_timeout").fetchone() == ("0",)
        teller.rollback()


def test_a_teller_that_listens_itself_is_told(db: str) -> None:
    """A session cannot see its own register, so its own LISTEN counts."""
    with psycopg.connect(db, autocommit=True) as conn:
        # A handler: psycopg 3.2 (the oldest declared) hands a notification that
        # arrives with a statement's answer to handlers, not to notifies().
        heard: list[str] = []
        conn.add_notify_handler(lambda n: heard.append(n.payload))
        conn.execute("LISTEN pgcoord_leases")
        assert conn.execute("select pgcoord.notify_heard('pgcoord_leases', 'self')").fetchone() == (True,)
        assert heard == ["self"]
