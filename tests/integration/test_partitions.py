"""Partitions: parts spread over live members, fenced, balanced, handed over in order."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest

import pgcoord
from pgcoord.partitions.assignment import balanced

from .conftest import advisory_locks, sql
from .converted_cancel import Converting

DRIVERS = ["asyncpg", "psycopg"]


def pname() -> str:
    return f"parts-{uuid.uuid4().hex[:8]}"


def lease_rows(dsn: str, name: str) -> dict[int, tuple[str | None, int]]:
    """{index: (holder, fence)} of every part's lease row."""
    rows = sql(dsn, "select name, holder, fence from pgcoord.leases where name like %s", name + "/%")
    return {int(str(n).rsplit("/", 1)[1]): (h, int(f)) for n, h, f in rows}  # type: ignore[call-overload]


async def eventually(check: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what or check}")
        await asyncio.sleep(0.02)


class Node:
    """A member running Partitions in this process, recording what its own() does."""

    def __init__(self, dsn: str, name: str, parts_name: str, count: int, *, ttl: float = 3.0,
                 driver: str = "asyncpg", log: list[tuple[str, str, int, int, float]] | None = None,
                 linger: float = 0.0) -> None:
        self.member = pgcoord.Member(dsn, group=f"g-{parts_name}", name=name, ttl=ttl, driver=driver)
        self.parts = pgcoord.Partitions(self.member, parts_name, count=count)
        self.name = name
        self.log = log if log is not None else []
        self.linger = linger
        self.task: asyncio.Task[None] | None = None
        self.running: set[int] = set()

    async def own(self, part: pgcoord.Partition) -> None:
        self.log.append(("start", self.name, part.index, part.fence, time.monotonic()))
        self.running.add(part.index)
        try:
            await asyncio.Event().wait()
        finally:
            if self.linger:
                await asyncio.sleep(self.linger)  # a cleanup that takes its time
            self.running.discard(part.index)
            self.log.append(("end", self.name, part.index, part.fence, time.monotonic()))

    async def start(self) -> Node:
        await self.member.open()
        self.task = asyncio.create_task(self.parts.run(self.own))
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        await self.member.close()


@contextlib.asynccontextmanager
async def nodes(dsn: str, parts_name: str, count: int, names: list[str], **kw: Any) -> AsyncIterator[list[Node]]:
    started: list[Node] = []
    try:
        for n in names:
            started.append(await Node(dsn, n, parts_name, count, **kw).start())
        yield started
    finally:
        for node in started:
            await node.stop()


def balanced_over(nodes_: list[Node], count: int) -> bool:
    """Every part's own() runs in exactly one node, and the nodes run ⌊N/M⌋..⌈N/M⌉ each."""
    sizes = [len(n.running) for n in nodes_]
    m = len(nodes_)
    return (sum(sizes) == count and set().union(*(n.running for n in nodes_)) == set(range(count))
            and all(count // m <= s <= -(-count // m) for s in sizes))


# -- the assignment itself --------------------------------------------------------------------


def test_assignment_is_balanced_and_moves_only_what_it_must() -> None:
    members = [f"m{i}/1" for i in range(5)]
    first = balanced("ingest", 64, members[:4], {})
    assert sorted(sorted(v for v in first.values()).count(m) for m in members[:4]) == [16, 16, 16, 16]
    # A join: the newcomer gets its share, taken from the others; nothing else moves.
    joined = balanced("ingest", 64, members, first)
    moved = [i for i in range(64) if joined[i] != first[i]]
    assert sorted(list(joined.values()).count(m) for m in members) == [12, 13, 13, 13, 13]
    assert all(joined[i] == members[4] for i in moved)
    assert len(moved) == list(joined.values()).count(members[4])
    # A leave: only the parts of the member that left move.
    left = balanced("ingest", 64, members[1:], joined)
    assert sorted(list(left.values()).count(m) for m in members[1:]) == [16, 16, 16, 16]
    assert [i for i in range(64) if left[i] != joined[i]] == sorted(
        i for i in range(64) if joined[i] == members[0])
    # The same facts give the same answer in any order.
    assert balanced("ingest", 64, list(reversed(members)), dict(reversed(list(first.items())))) == joined


def test_assignment_with_more_members_than_parts() -> None:
    result = balanced("few", 3, [f"m{i}" for i in range(5)], {})
    assert sorted(result) == [0, 1, 2] and len(set(result.values())) == 3


# -- one member --------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_lone_member_owns_every_part_and_each_is_fenced(dsn: str, driver: str) -> None:
    name = pname()
    async with nodes(dsn, name, 8, ["a"], driver=driver) as (a,):
        await eventually(lambda: a.running == set(range(8)), what="a runs all 8 parts")
        assert a.parts.owned == frozenset(range(8))
        assignment = await a.parts.assignment()
        assert assignment == {i: "a" for i in range(8)}
        rows = lease_rows(dsn, name)
        assert {i: h for i, (h, _f) in rows.items()} == {i: f"a/{a.member.id}" for i in range(8)}
        # The part's fence is its lease's: check_fence accepts it, and a stale one not.
        fence = next(f for kind, _n, i, f, _t in a.log if kind == "start" and i == 3)
        with psycopg.connect(dsn) as conn:
            conn.execute("select pgcoord.check_fence(%s, %s)", (f"{name}/3", fence))
        with psycopg.connect(dsn) as conn, pytest.raises(psycopg.Error, match="stale fence"):
            conn.execute("select pgcoord.check_fence(%s, %s)", (f"{name}/3", fence - 1))
        member_pid = a.member._main.backend_pid  # type: ignore[union-attr]
        assert len([lock for lock in advisory_locks(dsn) if lock[0] == member_pid]) == 1 + 8 + 1
        # Stopped (the member still open): every part given up, every doorbell and
        # the participation lock let go; only the member's own alive lock is left.
        assert a.task is not None
        a.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await a.task
        assert all(h is None for h, _f in lease_rows(dsn, name).values())
        assert len([lock for lock in advisory_locks(dsn) if lock[0] == member_pid]) == 1
    assert [e for e in a.log if e[0] == "end"] and len(a.log) == 16


async def test_bad_arguments_fail_at_construction(dsn: str) -> None:
    member = pgcoord.Member(dsn)
    with pytest.raises(TypeError):
        pgcoord.Partitions(dsn, "x", count=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pgcoord.Partitions(member, "x", count=0)
    with pytest.raises(TypeError):
        pgcoord.Partitions(member, "x", count=4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pgcoord.Partitions(member, "", count=4)
    with pytest.raises(ValueError):
        pgcoord.Partitions(member, "x", count=4, ttl=-1)
    parts = pgcoord.Partitions(member, "x", count=4)
    with pytest.raises(TypeError):
        await parts.run("not a function")  # type: ignore[arg-type]


# -- several members -----------------------------------------------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_joins_and_leaves_rebalance_moving_only_what_they_must(dsn: str, driver: str) -> None:
    name, count = pname(), 30
    async with nodes(dsn, name, count, ["a", "b"], driver=driver) as (a, b):
        await eventually(lambda: balanced_over([a, b], count), what="balanced over 2")
        before = await a.parts.assignment()
        c = await Node(dsn, "c", name, count, driver=driver).start()
        try:
            await eventually(lambda: balanced_over([a, b, c], count), what="balanced over 3")
            after = await a.parts.assignment()
            moved = [i for i in range(count) if after.get(i) != before.get(i)]
            assert sorted(after.get(i) for i in moved) == ["c"] * 10  # only the newcomer's share moved
            # Every part has exactly one owner running it.
            runs = [set(n.running) for n in (a, b, c)]
            assert sum(len(r) for r in runs) == count and set().union(*runs) == set(range(count))
        finally:
            await c.stop()
        await eventually(lambda: balanced_over([a, b], count), what="balanced over 2 again")
        again = await a.parts.assignment()
        assert [i for i in range(count) if again[i] != after[i]] == sorted(
            i for i in range(count) if after[i] == "c")


async def test_on_a_join_the_old_owner_s_own_finishes_before_the_new_owner_s_starts(dsn: str) -> None:
    name, count = pname(), 6
    log: list[tuple[str, str, int, int, float]] = []
    # The old owner's cleanup outlasts a renewal period (ttl 3: every 0.9 s), so the
    # part must stay renewed while it is handed over.
    async with nodes(dsn, name, count, ["a"], log=log, linger=1.2) as (a,):
        await eventually(lambda: len(a.running) == count)
        async with nodes(dsn, name, count, ["b"], log=log, linger=1.2) as (b,):
            await eventually(lambda: balanced_over([a, b], count), timeout=10)
            moved = sorted(b.running)
            assert len(moved) == 3
            for index in moved:
                ended = [t for kind, who, i, _f, t in log if (kind, who, i) == ("end", "a", index)]
                started = [(t, f) for kind, who, i, f, t in log if (kind, who, i) == ("start", "b", index)]
                old_fence = next(f for kind, who, i, f, _t in log if (kind, who, i) == ("start", "a", index))
                assert len(ended) == 1 and len(started) == 1
                assert ended[0] <= started[0][0], f"part {index}: b started before a had finished"
                assert started[0][1] > old_fence


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_terminated_member_s_parts_are_owned_again_at_once(dsn: str, driver: str) -> None:
    """ttl 10 s: the parts' periodic look comes every 2.4 s at the soonest, so only the
    member's crash news can make the takeover as quick as asserted."""
    name, count = pname(), 12
    log: list[tuple[str, str, int, int, float]] = []
    async with nodes(dsn, name, count, ["a", "b", "c"], ttl=10.0, driver=driver, log=log) as (a, b, c):
        await eventually(lambda: balanced_over([a, b, c], count))
        old = {i: c.parts._held[i].part.fence for i in c.running}
        index = min(old)
        pid = c.member._main.backend_pid  # type: ignore[union-attr]
        t0 = time.monotonic()
        sql(dsn, "select pg_terminate_backend(%s)", pid)

        def owned_again() -> bool:  # by anyone, c's next session included, with a greater fence
            return all(any(kind == "start" and i == part and f > fence for kind, _w, i, f, _t in log)
                       for part, fence in old.items())

        await eventually(owned_again, timeout=5.0, what="orphans owned again")
        assert time.monotonic() - t0 < 1.5
        # A write still carrying c's fence (c paused mid-write, say) is rejected.
        with psycopg.connect(dsn) as conn, pytest.raises(pgcoord.StaleFence):
            pgcoord.check_fence(conn, f"{name}/{index}", old[index])
        # c's own() calls were cancelled when its session went; it rejoins under a
        # new id and the parts are balanced over three again.
        await eventually(lambda: balanced_over([a, b, c], count), timeout=10)
        rows = lease_rows(dsn, name)
        assert len({h for h, _f in rows.values()}) == 3


async def test_a_part_under_constant_fenced_writes_stays_owned(dsn: str) -> None:
    """Back-to-back fenced transactions hold the part's row FOR SHARE nearly all the
    time; renewals must still get through (they wait briefly for the current one)."""
    name = pname()
    starts: list[int] = []
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)

    async def own(part: pgcoord.Partition) -> None:
        starts.append(part.fence)
        while True:
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, part.name, part.fence)
                await conn.execute("select pg_sleep(0.03)")

    try:
        async with pgcoord.Member(dsn, name="busy", ttl=1.5) as member:
            parts = pgcoord.Partitions(member, name, count=1)
            task = asyncio.create_task(parts.run(own))
            await asyncio.sleep(4.0)  # several trust windows (1.35 s)
            assert starts and len(starts) == 1, f"own() restarted with fences {starts}"
            assert parts.owned == frozenset({0})
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        await pool.close()


async def test_own_cleanups_run_to_their_end(dsn: str) -> None:
    """After a lost session own() is cancelled until it ends (the part may have a new
    owner already), so a cleanup that must finish shields itself; stopping cancels
    own() once and waits for a cleanup longer than any bound before giving parts up."""
    name = pname()
    flushed: list[str] = []

    async def flush(fence: int) -> None:
        await asyncio.sleep(0.3)
        flushed.append(f"session-{fence}")

    async def own(part: pgcoord.Partition) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.shield(flush(part.fence))

    async with pgcoord.Member(dsn, name="flusher", ttl=3.0) as member:
        parts = pgcoord.Partitions(member, name, count=2)
        task = asyncio.create_task(parts.run(own))
        await eventually(lambda: parts.owned == frozenset({0, 1}))
        sql(dsn, "select pg_terminate_backend(%s)", member._main.backend_pid)  # type: ignore[union-attr]
        await eventually(lambda: len(flushed) == 2, what="both cleanups finished")
        await eventually(lambda: parts.owned == frozenset({0, 1}), timeout=10)  # owned again after the rejoin
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert len(flushed) == 4
        assert all(h is None for h, _f in lease_rows(dsn, name).values())


@pytest.mark.slow
async def test_stopping_waits_for_an_own_slower_than_the_cleanup_bound(dsn: str) -> None:
    name = pname()
    ended: list[float] = []

    async def own(part: pgcoord.Partition) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(5.5)  # past CLEANUP_TIMEOUT (5 s)
            ended.append(time.monotonic())

    async with pgcoord.Member(dsn, name="slow", ttl=3.0) as member:
        parts = pgcoord.Partitions(member, name, count=1)
        task = asyncio.create_task(parts.run(own))
        await eventually(lambda: parts.owned == frozenset({0}))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert ended
        pid = member._main.backend_pid  # type: ignore[union-attr]
        assert lease_rows(dsn, name)[0][0] is None
        assert len([lock for lock in advisory_locks(dsn) if lock[0] == pid]) == 1  # the alive lock only
        # It can run again.
        again = asyncio.create_task(parts.run(own))
        await eventually(lambda: parts.owned == frozenset({0}))
        again.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await again


async def test_misuse_is_refused_or_loud(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    name = pname()

    async def own(part: pgcoord.Partition) -> None:
        await asyncio.Event().wait()

    async with pgcoord.Member(dsn, name="m1", ttl=3.0) as m1, pgcoord.Member(dsn, name="m2", ttl=3.0) as m2:
        first = pgcoord.Partitions(m1, name, count=4)
        task = asyncio.create_task(first.run(own))
        await eventually(lambda: first.owned == frozenset(range(4)))
        # A second partitioning of the same name on the same member.
        with pytest.raises(RuntimeError, match="already runs on this member"):
            await pgcoord.Partitions(m1, name, count=4).run(own)
        # Another member with a larger count: the smaller side says so.
        bigger = pgcoord.Partitions(m2, name, count=8)
        other = asyncio.create_task(bigger.run(own))
        await eventually(lambda: "larger count" in caplog.text or "more than count=4" in caplog.text,
                         timeout=8, what="the count mismatch logged")
        for t in (task, other):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    # run() cancelled before it got going leaves nothing behind and can start again.
    async with pgcoord.Member(dsn, name="m3", ttl=3.0) as m3:
        parts = pgcoord.Partitions(m3, name, count=2)
        early = asyncio.create_task(parts.run(own))
        await asyncio.sleep(0)
        early.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await early
        again = asyncio.create_task(parts.run(own))
        await eventually(lambda: parts.owned == frozenset({0, 1}))
        again.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await again
    # The member closed under run(): run() ends with RuntimeError.
    member = pgcoord.Member(dsn, name="m4", ttl=3.0)
    await member.open()
    parts = pgcoord.Partitions(member, name, count=2)
    running = asyncio.create_task(parts.run(own))
    await eventually(lambda: len(parts.owned) == 2)
    await member.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(running, 5)


# -- real processes ---------------------------------------------------------------------------------

REPLICA = str(Path(__file__).with_name("partitions_replica.py"))


class Fleet:
    """Partitions processes; each one's output lines as they come."""

    def __init__(self, dsn: str, name: str, count: int, ttl: float, driver: str = "asyncpg",
                 table: str | None = None) -> None:
        self.dsn, self.name, self.count, self.ttl, self.driver, self.table = dsn, name, count, ttl, driver, table
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: dict[str, list[str]] = {}

    def spawn(self, member: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        args = [sys.executable, REPLICA, self.dsn, self.name, str(self.count), member, str(self.ttl), self.driver]
        if self.table:
            args.append(self.table)
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        self.procs[member], self.lines[member] = proc, lines
        threading.Thread(target=lambda: [lines.append(ln.strip()) for ln in proc.stdout],  # type: ignore[union-attr]
                         daemon=True).start()

    def running(self, member: str) -> set[int]:
        """Parts whose own() has started and not ended in ``member``."""
        now: set[int] = set()
        for line in list(self.lines[member]):
            word, *rest = line.split()
            if word == "OWN":
                now.add(int(rest[0]))
            elif word == "END":
                now.discard(int(rest[0]))
        return now

    def wait_for(self, check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out: {what}; output: {self.lines}")
            time.sleep(0.02)

    def balanced(self, members: list[str]) -> bool:
        sizes = [len(self.running(m)) for m in members]
        covered = set().union(*(self.running(m) for m in members))
        m = len(members)
        return covered == set(range(self.count)) and sum(sizes) == self.count and all(
            self.count // m <= s <= -(-self.count // m) for s in sizes)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()


@pytest.fixture
def writes_table(dsn: str) -> Iterator[str]:
    table = f"part_writes_{uuid.uuid4().hex[:8]}"
    sql(dsn, f"create table {table} (id bigserial primary key, part int not null, fence bigint not null,"
             " writer text not null)")
    yield table
    sql(dsn, f"drop table {table}")


def fences_only_grow(dsn: str, table: str) -> None:
    """In commit order (the serial id), each part's fence never goes back, and each
    fence was written by one process only."""
    rows = sql(dsn, f"select part, fence, writer from {table} order by id")
    last: dict[int, int] = {}
    writers: dict[tuple[int, int], set[str]] = {}
    for part, fence, writer in rows:  # type: ignore[misc]
        assert fence >= last.get(part, 0), f"part {part}: fence {fence} written after {last[part]}"
        last[part] = fence
        writers.setdefault((part, fence), set()).add(writer)
    assert all(len(w) == 1 for w in writers.values()), writers
    assert rows, "no fenced write happened"


@pytest.mark.slow
def test_processes_killed_paused_and_joining_never_make_two_owners(dsn: str, writes_table: str) -> None:
    """Three processes doing fenced writes for 12 parts: one SIGKILLed, one
    SIGSTOPped past its ttl then resumed, one joining. Orphaned parts are owned
    again at once (the kill) or once the server ends the silent session (the
    pause); the paused process's writes with its old fences are rejected; fences
    only grow in commit order; and the parts end balanced."""
    ttl = 2.0
    fleet = Fleet(dsn, pname(), 12, ttl, table=writes_table)
    try:
        for m in ("a", "b", "c"):
            fleet.spawn(m)
        fleet.wait_for(lambda: fleet.balanced(["a", "b", "c"]), what="balanced over a, b, c")
        # SIGKILL: the orphans are owned again long before the ttl.
        orphans = fleet.running("c")
        killed_at = time.monotonic()
        fleet.procs["c"].kill()
        fleet.wait_for(lambda: orphans <= fleet.running("a") | fleet.running("b"), timeout=5.0,
                       what="c's parts owned again")
        assert time.monotonic() - killed_at < ttl
        fleet.wait_for(lambda: fleet.balanced(["a", "b"]), what="balanced over a, b")
        # SIGSTOP b past its ttl: the server ends its silent session, a takes over;
        # b, resumed, finds its fences stale.
        paused = fleet.running("b")
        fleet.procs["b"].send_signal(signal.SIGSTOP)
        fleet.wait_for(lambda: fleet.running("a") == set(range(12)), timeout=ttl * 4, what="a owns all")
        fleet.procs["b"].send_signal(signal.SIGCONT)
        # b notices its lost session, stops its own() calls, rejoins; then d joins.
        fleet.wait_for(lambda: not (fleet.running("b") & fleet.running("a")), timeout=10, what="b stops")
        fleet.spawn("d")
        fleet.wait_for(lambda: fleet.balanced(["a", "b", "d"]), timeout=15, what="balanced over a, b, d")
        time.sleep(0.3)
        assert paused
        fences_only_grow(dsn, writes_table)
    finally:
        fleet.stop()


@pytest.mark.slow
def test_two_processes_killed_at_once_leave_no_part_unowned(dsn: str) -> None:
    """ttl 30 s: the periodic look comes every 7 s at the soonest, so only the crash
    news can make this quick."""
    fleet = Fleet(dsn, pname(), 16, ttl=30.0)
    try:
        for m in ("a", "b", "c", "d"):
            fleet.spawn(m)
        fleet.wait_for(lambda: fleet.balanced(["a", "b", "c", "d"]), what="balanced over four")
        killed_at = time.monotonic()
        fleet.procs["c"].kill()
        fleet.procs["d"].kill()
        fleet.wait_for(lambda: fleet.balanced(["a", "b"]), timeout=5.0, what="balanced over a, b")
        assert time.monotonic() - killed_at < 2.0
    finally:
        fleet.stop()


async def test_behind_a_transaction_mode_pooler_partitions_refuse(dsn: str) -> None:
    from .pgbouncer import PgBouncer

    bouncer = PgBouncer(int(dsn.rsplit(":", 1)[1].split("/")[0]))
    try:
        async with pgcoord.Member(bouncer.dsn(dsn), ttl=2.0, driver="psycopg") as member:
            assert member.polling is True
            parts = pgcoord.Partitions(member, pname(), count=4)

            async def own(part: pgcoord.Partition) -> None:
                raise AssertionError("no part may be owned without a session")

            with pytest.raises(pgcoord.UnsupportedConnection, match="pooler"):
                await asyncio.wait_for(parts.run(own), 10)
    finally:
        bouncer.stop()


async def test_an_own_that_fails_is_started_again_while_its_part_stays_owned(dsn: str) -> None:
    import pgcoord.partitions.partitions as partitions_module

    calls: list[int] = []

    async def own(part: pgcoord.Partition) -> None:
        calls.append(part.fence)
        if len(calls) < 3:
            raise RuntimeError("flaky consumer")
        await asyncio.Event().wait()

    old = partitions_module.RESTART_FIRST
    partitions_module.RESTART_FIRST = 0.05
    try:
        async with pgcoord.Member(dsn, name="solo") as member:
            parts = pgcoord.Partitions(member, pname(), count=1)
            task = asyncio.create_task(parts.run(own))
            await eventually(lambda: len(calls) == 3, what="own() started three times")
            assert parts.owned == frozenset({0}) and len(set(calls)) == 1  # same ownership, same fence
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        partitions_module.RESTART_FIRST = old


@pytest.mark.parametrize("fails_how", ["retries", "raises"])
async def test_an_own_that_takes_its_cancellation_for_an_error_is_stopped(
    dsn: str, fails_how: str,
) -> None:
    """A driver may turn the cancellation of a lost part's own() into an error (psycopg
    does when the connection breaks during a cancelled statement, as when the server
    goes). own() that retries on errors is cancelled again until it ends; one that
    raises it is not started again. Either way it ends at once, not never."""
    import pgcoord.partitions.partitions as partitions_module

    own = Converting(retries=fails_how == "retries")
    fences: list[int] = []

    async def owning(part: pgcoord.Partition) -> None:
        fences.append(part.fence)
        await own()

    old = partitions_module.RESTART_FIRST
    partitions_module.RESTART_FIRST = 0.05  # a restart, if any, would come at once
    try:
        async with pgcoord.Member(dsn, name="retrier", ttl=3.0) as member:
            parts = pgcoord.Partitions(member, pname(), count=1)
            task = asyncio.create_task(parts.run(owning))
            await eventually(lambda: parts.owned == frozenset({0}) and fences)
            lost_fence = fences[0]
            lost_at = time.monotonic()
            sql(dsn, "select pg_terminate_backend(%s)", member._main.backend_pid)  # type: ignore[union-attr]
            await eventually(lambda: own.ended, timeout=5.0, what="own() ended")
            assert own.errors == 1 and own.ended[0] - lost_at < 2.0
            # Owned again after the rejoin, under a new fence; never started again
            # under the lost one.
            await eventually(lambda: any(f > lost_fence for f in fences), timeout=10.0)
            assert fences.count(lost_fence) == 1, fences
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        partitions_module.RESTART_FIRST = old
