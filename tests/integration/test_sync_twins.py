"""pgcoord.sync: the twins run the async implementation for code without an event loop,
with the same guarantees: locks lost with their session, failover across processes,
fenced leases, one run per slot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg_pool
import pytest

import pgcoord
import pgcoord.sync
from pgcoord import testing

from .conftest import advisory_locks, sql

REPLICA = str(Path(__file__).with_name("sync_elector_replica.py"))


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def poll(check: Callable[[], Any], within: float = 5.0, what: str = "") -> Any:
    deadline = time.monotonic() + within
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.01)
    return result


def test_sync_lock_holder_excludes_and_tells_a_block_its_lock_is_lost(dsn: str) -> None:
    key = name("sync-lock")
    with pgcoord.sync.LockHolder(dsn) as holder, pgcoord.sync.LockHolder(dsn) as other:
        with holder.lock(key):
            assert [g for pid, _k, g in advisory_locks(dsn) if pid == holder.backend_pid] == [True]
            with pytest.raises(pgcoord.LockBusy):
                with other.lock(key, wait=False):
                    pass
        # Threads contending through one holder take turns.
        inside: list[int] = []
        overlaps: list[int] = []

        def worker(i: int) -> None:
            for _ in range(5):
                with holder.lock(key):
                    inside.append(i)
                    if len(inside) > 1:
                        overlaps.append(i)
                    time.sleep(0.005)
                    inside.remove(i)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert overlaps == []
        # The session dies while a block holds the lock: the block is told at once
        # (held.lost), and leaving it raises LockLost.
        started = time.monotonic()
        with pytest.raises(pgcoord.LockLost):
            with holder.lock(key) as held:
                assert held.lost is False
                sql(dsn, "select pg_terminate_backend(%s)", holder.backend_pid)
                poll(lambda: held.lost, what="the loss told to the block")
        assert time.monotonic() - started < 5
        with other.lock(key, wait=False):  # free again
            pass
    assert advisory_locks(dsn) == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_electors_in_processes_fail_over_when_the_leader_is_killed(dsn: str, mode: str) -> None:
    """The same test for pgcoord.Elector and its twin: two processes (ttl 30 s); the
    leader is SIGKILLed; the other leads within a second (its session's end, not the
    ttl), with a greater fence."""
    lease = name("sync-duty")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs: list[subprocess.Popen[str]] = []
    lines: list[list[str]] = []
    try:
        for _ in range(2):
            proc = subprocess.Popen([sys.executable, REPLICA, dsn, lease, "30", mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env)
            out: list[str] = []
            threading.Thread(target=lambda p=proc, o=out: [o.append(ln.strip()) for ln in p.stdout],  # type: ignore[union-attr, misc]
                             daemon=True).start()
            procs.append(proc)
            lines.append(out)
        poll(lambda: any(ln.startswith("LEAD") for o in lines for ln in o), within=20, what="a leader")
        leader = next(i for i, o in enumerate(lines) if any(ln.startswith("LEAD") for ln in o))
        first = int(next(ln for ln in lines[leader] if ln.startswith("LEAD")).split()[1])
        time.sleep(0.3)
        killed = time.time()
        procs[leader].kill()
        other = 1 - leader
        line = poll(lambda: next((ln for ln in lines[other] if ln.startswith("LEAD")), None), within=10,
                    what="the other process leads")
        _, fence, at = line.split()
        assert int(fence) > first
        assert float(at) - killed < 1.0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_sync_lease_fences_writes_and_tells_the_block_when_taken_over(dsn: str) -> None:
    lease_name = name("sync-lease")
    sql(dsn, f"create table {lease_name.replace('-', '_')} (fence bigint)")
    table = lease_name.replace("-", "_")
    with psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=3) as pool:
        lease = pgcoord.sync.Lease(pool, lease_name, ttl=3.0)
        try:
            with pytest.raises(pgcoord.LeaseLost):
                with lease as fence:
                    with pool.connection() as conn, conn.transaction():
                        pgcoord.check_fence(conn, lease_name, fence)
                        conn.execute(f"insert into {table} values (%s)", (fence,))
                    import asyncio

                    outsider = asyncio.run(testing.take_leadership(dsn, lease_name))
                    assert outsider > fence
                    poll(lambda: lease.lost, what="the lease's loss told to the block")
                    with pool.connection() as conn, pytest.raises(pgcoord.StaleFence):
                        with conn.transaction():
                            pgcoord.check_fence(conn, lease_name, fence)
        finally:
            lease.close()
    assert sql(dsn, f"select fence from {table}") == [(fence,)]


def test_sync_schedulers_run_each_slot_once(dsn: str) -> None:
    job = name("sync-job")
    runs: list[str] = []
    lock = threading.Lock()
    scheds = [pgcoord.sync.Scheduler(dsn) for _ in range(2)]
    for sched in scheds:
        @sched.cron(job, "* * * * * *")
        def tick(slot: pgcoord.Slot) -> None:
            with lock:
                runs.append(slot.key)

    threads = [threading.Thread(target=s.run) for s in scheds]
    for t in threads:
        t.start()
    try:
        time.sleep(3.5)
    finally:
        for s in scheds:
            s.stop()
        for t in threads:
            t.join(timeout=10)
        for s in scheds:
            s.close()
    assert len(runs) >= 2 and len(runs) == len(set(runs)), runs
    states = sql(dsn, "select state, count(*) from pgcoord.job_slots where job = %s group by state", job)
    assert dict(states)["succeeded"] == len(runs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transactional"):
        scheds[0].cron(name("x"), "* * * * *", transactional=True)


def test_sync_member_sees_peers_and_a_departure(dsn: str) -> None:
    group = name("sync-group")
    with pgcoord.sync.Member(dsn, group=group, name="a") as a:
        changes = a.watch(timeout=5)
        with pgcoord.sync.Member(dsn, group=group, name="b") as b:
            assert sorted(p.name for p in a.peers()) == ["a", "b"]
            assert b.has_session
        seen = []
        for change in changes:
            seen.append(change)
            if isinstance(change, pgcoord.MemberLeft):
                break
        assert isinstance(seen[-1], pgcoord.MemberLeft) and seen[-1].member.name == "b"
        # A sync holder and elector on the member share its session.
        with pgcoord.sync.LockHolder(a) as holder, holder.lock(name("k")):
            assert holder.backend_pid == a._async._main.backend_pid


def test_sync_twins_refuse_what_they_cannot_run(dsn: str) -> None:
    with pytest.raises(TypeError):
        pgcoord.sync.LockHolder(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pgcoord.sync.Scheduler(object())
    sched = pgcoord.sync.Scheduler(dsn)
    try:
        with pytest.raises(TypeError, match="plain functions"):
            @sched.cron(name("async"), "* * * * *")
            async def job(slot: pgcoord.Slot) -> None:
                pass
    finally:
        sched.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_lock_lost_with_its_session_stops_the_body_and_raises_lock_lost(dsn: str, mode: str) -> None:
    """The same guarantee for LockHolder and its twin: the body learns at once that its
    session is gone (async: cancelled; sync: told), and leaving raises LockLost."""
    import asyncio

    key = name("lost")
    stopped: list[float] = []
    started = time.monotonic()
    if mode == "async":
        async def scenario() -> None:
            async with pgcoord.LockHolder(dsn) as holder:
                with pytest.raises(pgcoord.LockLost):
                    async with holder.lock(key):
                        try:  # the cancellation may come at either await
                            await asyncio.to_thread(sql, dsn, "select pg_terminate_backend(%s)",
                                                    holder.backend_pid)
                            await asyncio.sleep(30)
                        finally:
                            stopped.append(time.monotonic())

        asyncio.run(scenario())
    else:
        with pgcoord.sync.LockHolder(dsn) as holder:
            with pytest.raises(pgcoord.LockLost):
                with holder.lock(key) as held:
                    sql(dsn, "select pg_terminate_backend(%s)", holder.backend_pid)
                    deadline = time.monotonic() + 30
                    while not held.lost and time.monotonic() < deadline:
                        time.sleep(0.01)
                    stopped.append(time.monotonic())
    assert stopped and stopped[0] - started < 5
    assert [lock for lock in advisory_locks(dsn) if lock[1] == pgcoord.lock_key(key)] == []


def test_sync_watch_subscribes_at_once_and_closes(dsn: str) -> None:
    group = name("watchers")
    with pgcoord.sync.Member(dsn, group=group, name="w") as member:
        subscribers = member._async._subscribers
        before = len(subscribers)
        idle = [member.watch() for _ in range(5)]
        assert len(subscribers) == before + 5
        for changes in idle:
            changes.close()
        poll(lambda: len(subscribers) == before, what="closed watches unsubscribed")
        with member.watch(timeout=5) as changes:
            with pgcoord.sync.Member(dsn, group=group, name="x"):
                pass
            kinds = [type(c).__name__ for c in changes if True]
        assert kinds[:2] == ["MemberJoined", "MemberLeft"] or "MemberLeft" in kinds
        with pytest.raises(AttributeError, match="no sync form"):
            member.session()


def test_sync_lease_takes_a_key_value_dsn(dsn: str) -> None:
    """libpq's key=value form (the multi-host one in docs/operations.md) works for the
    twins that open a pool of their own, as for those that open sessions."""
    from urllib.parse import urlsplit

    url = urlsplit(dsn)
    key_value = f"host={url.hostname} port={url.port} dbname={url.path.lstrip('/')} user={url.username}"
    lease = pgcoord.sync.Lease(key_value, name("kv-lease"), ttl=3.0)
    try:
        with lease as fence:
            assert fence >= 1
    finally:
        lease.close()
