"""A plain ``Elector(dsn)`` listens only while it leads or is watched.

A listening session is signalled by every NOTIFY in the database (before
PostgreSQL 19), so followers, which the doorbell wakes, listen to nothing; the
handover stays as fast after a release and after the leader's process is killed,
and ``watch()`` still sees every change. Who listens is read from the register of
listeners (``pgcoord.ears_open``: a shared session lock per channel, held by every
session that LISTENs to it through pgcoord).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg

import pgcoord
from pgcoord.elector import LeaderChanged

EARS_NS = 1885823854
LEASES = 1
REPLICA = str(Path(__file__).with_name("elector_replica.py"))


def listeners(dsn: str) -> list[int]:
    """The pids registered as listeners of the lease channel."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(r[0] for r in conn.execute(
            "select pid from pg_locks where locktype = 'advisory' and granted and objsubid = 2"
            " and classid = %s and objid = %s and mode = 'ShareLock'", (EARS_NS, LEASES)).fetchall())


def waiting_on_doorbell(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("select wait_event from pg_stat_activity where pid = %s", (pid,)).fetchone()
        return row is not None and row[0] == "advisory"


async def until(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def election() -> str:
    return f"listen:{uuid.uuid4().hex[:8]}"


async def forever(fence: int) -> None:
    await asyncio.sleep(3600)


def pid_of(elector: pgcoord.Elector) -> int:
    assert elector._conn is not None
    return int(elector._conn.backend_pid)


async def test_only_the_leader_listens_and_a_release_hands_over_at_once(dsn: str) -> None:
    name = election()
    electors = [pgcoord.Elector(dsn, name, ttl=30.0, holder=f"r{i}") for i in range(3)]
    runs = [asyncio.create_task(e.run(forever)) for e in electors]
    try:
        await until(lambda: any(e.is_leader for e in electors), 10)
        leader = next(e for e in electors if e.is_leader)
        followers = [e for e in electors if e is not leader]
        await until(lambda: all(e._conn is not None and waiting_on_doorbell(dsn, pid_of(e))
                                for e in followers), 10)
        await until(lambda: pid_of(leader) in listeners(dsn), 5)
        mine = {pid_of(e) for e in electors}
        assert [p for p in listeners(dsn) if p in mine] == [pid_of(leader)]
        # A release hands over at once: the ttl is 30 s, and a follower looks at
        # the lease on its own only once a ttl.
        stopped = time.monotonic()
        await leader.stop()
        await until(lambda: any(e.is_leader for e in followers), 2.0)
        assert time.monotonic() - stopped < 2.0
        new = next(e for e in followers if e.is_leader)
        await until(lambda: pid_of(new) in listeners(dsn), 5)
        assert [p for p in listeners(dsn) if p in mine] == [pid_of(new)]
    finally:
        for e in electors:
            await e.stop()
        await asyncio.gather(*runs, return_exceptions=True)


def test_a_killed_leader_process_is_replaced_at_once_by_a_follower_that_listens_to_nothing(
        dsn: str) -> None:
    name = election()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("create table if not exists elections (id serial primary key,"
                     " replica text, fence bigint, at timestamptz default clock_timestamp())")
        conn.execute("create table if not exists fenced_writes (id serial primary key,"
                     " replica text, fence bigint, at timestamptz default clock_timestamp())")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = {label: subprocess.Popen([sys.executable, REPLICA, dsn, name, "30", label],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for label in (f"a-{name}", f"b-{name}")}

    def elections() -> list[tuple[str, float]]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            return [(str(r), float(t)) for r, t in conn.execute(
                "select replica, extract(epoch from at) from elections where replica = any(%s)"
                " order by id", (list(procs),)).fetchall()]

    def apps_waiting() -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("select count(*) from pg_stat_activity where wait_event = 'advisory'"
                               " and application_name = %s", (f"pgcoord-elector:{name}",)).fetchone()
            return int(row[0]) if row else 0

    try:
        deadline = time.monotonic() + 20
        while not elections() or apps_waiting() < 1:
            assert time.monotonic() < deadline, "no leader and follower in time"
            time.sleep(0.05)
        first, _ = elections()[0]
        with psycopg.connect(dsn, autocommit=True) as conn:
            pids = [r[0] for r in conn.execute(
                "select pid from pg_stat_activity where application_name = %s",
                (f"pgcoord-elector:{name}",)).fetchall()]
        assert len(pids) == 2
        # Only the leader's session is registered as a listener.
        assert len([p for p in listeners(dsn) if p in pids]) == 1
        with psycopg.connect(dsn, autocommit=True) as conn:
            killed_at = float(conn.execute("select extract(epoch from clock_timestamp())").fetchone()[0])  # type: ignore[index]
        procs[first].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while len(elections()) < 2:
            assert time.monotonic() < deadline, "no takeover within 5 s (ttl 30)"
            time.sleep(0.01)
        second, at = elections()[1]
        assert second != first
        assert at - killed_at < 2.0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(10)


async def test_watching_a_waiting_follower_makes_it_listen_and_see_every_change(dsn: str) -> None:
    name = election()
    a = pgcoord.Elector(dsn, name, ttl=30.0, holder="a")
    b = pgcoord.Elector(dsn, name, ttl=30.0, holder="b")
    run_a = asyncio.create_task(a.run(forever))
    await until(lambda: a.is_leader, 10)
    run_b = asyncio.create_task(b.run(forever))
    seen: list[LeaderChanged] = []
    collecting: asyncio.Task[None] | None = None
    try:
        await until(lambda: b._conn is not None and waiting_on_doorbell(dsn, pid_of(b)), 10)
        assert pid_of(b) not in listeners(dsn)
        changes = b.watch()

        async def collect() -> None:
            async for change in changes:
                seen.append(change)

        collecting = asyncio.create_task(collect())
        # The watch() cut the doorbell wait; the follower listens, then waits again.
        await until(lambda: pid_of(b) in listeners(dsn), 5)
        await until(lambda: waiting_on_doorbell(dsn, pid_of(b)), 5)
        fence_a = a.fence
        await a.stop()
        await until(lambda: b.is_leader, 2.0)
        await until(lambda: len(seen) >= 2, 2.0)
        assert seen[:2] == [LeaderChanged(None, fence_a), LeaderChanged("b", b.fence)]
    finally:
        await a.stop()
        await b.stop()
        await asyncio.gather(run_a, run_b, return_exceptions=True)
        if collecting is not None:
            collecting.cancel()
