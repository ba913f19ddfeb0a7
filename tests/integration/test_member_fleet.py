"""Members as good guests of a large fleet: a member LISTENs only while something on
it needs news (every listening session is signalled by every NOTIFY in the
database), and what used to come by broadcast comes by a poke of the one session
that needs it (docs/members.md, "What a member costs")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

import pgcoord

from .conftest import migrated_database, sql

REPLICA = str(Path(__file__).with_name("member_replica.py"))


def group() -> str:
    return f"fleet-{uuid.uuid4().hex[:6]}"


async def channels(member: pgcoord.Member) -> list[str]:
    """What the member's main session LISTENs to, asked on that session itself."""
    return sorted(await member._call("SELECT coalesce(pg_catalog.array_agg(c), '{}')::text[] "
                                     "FROM pg_catalog.pg_listening_channels() AS c"))


async def until(check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def services(dsn: str, n: int, ttl: float) -> AsyncIterator[list[pgcoord.Member]]:
    """n members, each running what a service runs: an elector, a held lock, a
    scheduler, and a lease waiting behind another member's."""
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    g, election, lease_name = group(), f"fleet:{uuid.uuid4().hex[:6]}", f"fleet-lease:{uuid.uuid4().hex[:6]}"
    async with contextlib.AsyncExitStack() as stack:
        members = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=ttl)) for _ in range(n)]
        tasks: list[asyncio.Task[object]] = []
        for i, member in enumerate(members):
            async def lead(fence: int) -> None:
                await asyncio.sleep(3600)

            tasks.append(asyncio.create_task(pgcoord.Elector(member, election, ttl=ttl).run(lead)))
            holder = await stack.enter_async_context(pgcoord.LockHolder(member))
            await stack.enter_async_context(holder.lock(f"fleet-lock:{g}:{i}"))
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(f"fleet-job:{g}", "0 0 1 1 *")
            async def job() -> None:
                pass

            tasks.append(asyncio.create_task(sched.run()))
        held = await stack.enter_async_context(pgcoord.Lease(pool, lease_name, ttl=ttl, member=members[0]))
        assert held
        waiting = asyncio.create_task(pgcoord.Lease(pool, lease_name, ttl=ttl, member=members[1]).acquire())
        tasks.append(waiting)  # type: ignore[arg-type]
        try:
            yield members
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()


async def test_a_member_running_a_service_listens_to_nothing(dsn: str) -> None:
    async with services(dsn, 3, ttl=3.0) as members:
        await asyncio.sleep(1.5)  # past the first heartbeat (ttl/3)
        for member in members:
            assert await channels(member) == []


async def test_watch_listens_while_it_is_used(dsn: str) -> None:
    async with pgcoord.Member(dsn, group=group(), ttl=3.0) as a, pgcoord.Member(dsn, group=group(), ttl=3.0):
        await asyncio.sleep(1.5)
        assert await channels(a) == []
        changes = a.watch()
        await until(lambda: "pgcoord_members" in a._listening, 3)
        assert await channels(a) == ["pgcoord_members"]
        changes.close()
        await asyncio.sleep(1.5)  # the next heartbeat lets go of it
        assert await channels(a) == []


async def test_a_member_alone_in_the_ring_listens_for_the_next_one(dsn: str) -> None:
    # Alone (the ring spans every group of the database: this test's server may
    # hold other members, so it looks only at what it knows).
    async with pgcoord.Member(dsn, group=group(), ttl=3.0) as a:
        if a._ring.successor() is None:
            assert await channels(a) == ["pgcoord_members"]


def test_a_member_that_joins_between_two_is_watched_without_any_news(dsn: str) -> None:
    async def scenario() -> None:
        # ttl 30: the heartbeat sweep would take 10 s; only the watcher ring is quick.
        async with pgcoord.Member(dsn, group=group(), ttl=30) as a, \
                pgcoord.Member(dsn, group=group(), ttl=30) as b:
            await asyncio.sleep(0.5)
            assert await channels(a) == [] and await channels(b) == []
            joiner = subprocess.Popen([sys.executable, REPLICA, dsn, group(), "joiner", "30", "asyncpg"],
                                      stdout=subprocess.PIPE, text=True)
            try:
                assert joiner.stdout is not None
                line = await asyncio.to_thread(joiner.stdout.readline)
                joined = int(line.split()[1])
                # Someone in the ring must watch the joiner now, though nobody listens.
                await until(lambda: joined in (a._ring._target, b._ring._target), 5)
                joiner.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                await until(lambda: sql(dsn, "select left_reason from pgcoord.member_sessions where id = %s",
                                        joined) == [("crashed",)], 5)
                assert time.monotonic() - killed < 3.0
            finally:
                if joiner.poll() is None:
                    joiner.kill()
                joiner.wait()

    asyncio.run(scenario())


async def test_a_follower_that_listens_to_nothing_takes_over_a_released_lease_at_once(dsn: str) -> None:
    name = f"fleet-handover:{uuid.uuid4().hex[:6]}"
    terms: list[tuple[int, int, float]] = []

    def lead_as(i: int) -> object:
        async def lead(fence: int) -> None:
            terms.append((i, fence, time.monotonic()))
            await asyncio.sleep(3600)
        return lead

    async with pgcoord.Member(dsn, group=group(), ttl=30) as a, pgcoord.Member(dsn, group=group(), ttl=30) as b:
        electors = [pgcoord.Elector(a, name, ttl=30), pgcoord.Elector(b, name, ttl=30)]
        tasks = [asyncio.create_task(e.run(lead_as(i))) for i, e in enumerate(electors)]  # type: ignore[arg-type]
        try:
            await until(lambda: len(terms) == 1, 10)
            first = terms[0][0]
            assert await channels(a) == [] and await channels(b) == []
            stopped = time.monotonic()
            await electors[first].stop()
            # A third of a ttl is 10 s: only a poke can make it this quick.
            await until(lambda: len(terms) == 2, 3)
            assert terms[1][0] != first and terms[1][1] == terms[0][1] + 1
            assert terms[1][2] - stopped < 2.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- what the members' background work costs the server ----------------------------------------

@pytest.fixture
def counted_dsn(pg_server: Any) -> Iterator[str]:
    """A database of its own whose sessions count their function calls
    (pg_stat_user_functions), so that a test counts what the members really ran."""
    yield from migrated_database(pg_server, "pgcoord_counted", {"track_functions": "all"})


def calls(dsn: str, function: str) -> int:
    """Calls of pgcoord.``function`` counted so far (by sessions that have ended or
    reported: each member session reports at its end)."""
    rows = sql(dsn, "select coalesce(sum(calls), 0) from pg_stat_user_functions"
                    " where schemaname = 'pgcoord' and funcname = %s", function)
    return int(rows[0][0])


async def reported(dsn: str, function: str, at_least: int) -> int:
    """``calls()`` once the ended sessions' counts are in (they report as they exit)."""
    deadline = time.monotonic() + 5.0
    while (n := calls(dsn, function)) < at_least and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return n


async def test_one_member_sweeps_its_group_not_every_heartbeat(counted_dsn: str) -> None:
    # Every heartbeat used to sweep its group (a pg_locks scan) and read it (another):
    # at 100 members, 60 scans a second. One member of a group sweeps it now.
    ttl, n = 1.5, 6
    g = group()
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(n):
            await stack.enter_async_context(pgcoord.Member(counted_dsn, group=g, ttl=ttl))
        await asyncio.sleep(3.0)
    beats = await reported(counted_dsn, "member_beat", at_least=n * 4)
    sweeps = calls(counted_dsn, "member_reap_group")
    joins = calls(counted_dsn, "member_join")
    assert beats >= n * 4, beats  # every member beat every ttl/3
    # Each join sweeps too; beyond those, only the sweeper's beats do (the lowest id).
    # (Before: every beat swept, sweeps - joins == beats. Half leaves room for a loaded
    # host, where a late beat makes a second member sweep now and then.)
    assert sweeps - joins <= beats // 2, (sweeps, joins, beats)


async def test_member_bound_followers_do_not_ask_for_a_held_lease_between_news(
        counted_dsn: str) -> None:
    # A follower on a member used to ask for the lease every third of a ttl: an
    # INSERT ... ON CONFLICT that locked the lease's row and scanned pg_locks. Now it
    # reads whether the lease may be free, and asks only then.
    ttl, name = 1.5, f"quiet:{uuid.uuid4().hex[:6]}"
    led: list[int] = []
    async with contextlib.AsyncExitStack() as stack:
        members = [await stack.enter_async_context(pgcoord.Member(counted_dsn, group=group(), ttl=ttl))
                   for _ in range(4)]

        async def lead(fence: int) -> None:
            led.append(fence)
            await asyncio.sleep(3600)

        tasks = [asyncio.create_task(pgcoord.Elector(m, name, ttl=ttl).run(lead)) for m in members]
        try:
            await until(lambda: led, 5.0)
            await asyncio.sleep(3.0)  # six thirds of a ttl for every follower
            assert len(led) == 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    renewals = await reported(counted_dsn, "lease_renew_asking", at_least=4)
    asked = calls(counted_dsn, "lease_acquire")
    assert renewals >= 4
    # The leader's acquisition, and a try or so per follower as it started (19 before).
    assert asked <= 6, asked


async def test_a_member_s_scheduler_ticks_without_borrowing_from_the_pool(dsn: str) -> None:
    # Each tick read the change counter through the pool: a checkout, and (asyncpg) a
    # reset round trip to give the connection back, a second for every replica. With a
    # member, the tick runs on its session.
    checkouts = 0

    async def counted(_conn: asyncpg.Connection) -> None:
        nonlocal checkouts
        checkouts += 1

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, setup=counted)
    try:
        async with pgcoord.Member(dsn, group=group(), ttl=10) as member:
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(f"tick-job:{uuid.uuid4().hex[:6]}", "0 0 1 1 *")
            async def job() -> None:
                pass

            runner = asyncio.create_task(sched.run())
            try:
                await asyncio.sleep(2.0)  # the first ticks: loads, housekeeping
                before = checkouts
                await asyncio.sleep(4.0)  # four ticks
                # (A housekeeping chore may borrow one; four ticks borrowed four before.)
                assert checkouts - before <= 2, checkouts - before
            finally:
                await sched.stop()
                await runner
    finally:
        await pool.close()


# A process with several members, for the test below: prints each member's id and its
# main session's backend pid, then waits to be stopped and killed.
MANY = """
import asyncio, sys
import pgcoord

async def main(dsn, group, n):
    members = [pgcoord.Member(dsn, group=group, ttl=30) for _ in range(n)]
    for m in members:
        await m.open()
    print(" ".join(f"{m.id}:{m._main.backend_pid}" for m in members), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_members_of_a_process_that_dies_are_told_in_one_notify(dsn: str) -> None:
    # A process's sessions end one after another when it dies (milliseconds apart,
    # tens of them on a busy host). Each watcher granted a dead member's lock used to tell
    # what it found at once, so one process's death came as several NOTIFYs, each
    # signalling every listening session. The watcher now waits (50 ms at most) for the
    # dead member's siblings in the same process, and tells them together.
    g = group()
    heard: list[list[int]] = []
    listener = await asyncpg.connect(dsn)

    def on_news(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        news = json.loads(payload)
        if news.get("ev") == "left" and news.get("group") == g:
            heard.append([int(i) for i, _ in (news.get("ids") or [[news["id"], None]])])

    await listener.add_listener("pgcoord_members", on_news)
    # The observer registers as a listener (pgcoord.ears_open), so that news is sent.
    async with pgcoord.Member(dsn, group=g, ttl=30) as observer:
        changes = observer.watch()
        child = subprocess.Popen([sys.executable, "-c", MANY, dsn, g, "4"], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            line = await asyncio.to_thread(child.stdout.readline)
            ids = {int(p.split(":")[0]): int(p.split(":")[1]) for p in line.split()}
            await asyncio.sleep(0.5)  # every member watched by now
            # The process stops; the server ends its members' sessions 8 ms apart, as
            # it ends a dead process's one after another.
            child.send_signal(signal.SIGSTOP)
            sent = []
            for pid in ids.values():
                sent.append(time.monotonic())
                await listener.execute("select pg_terminate_backend($1)", pid)
                await asyncio.sleep(0.008)
            told: set[int] = set()
            while not set(ids) <= told:
                change = await asyncio.wait_for(changes.__anext__(), 5.0)
                if isinstance(change, pgcoord.MemberLeft):
                    told.add(change.member.id)
            await asyncio.sleep(0.3)  # any later NOTIFY of the same deaths
            mine = [batch for batch in heard if set(batch) & set(ids)]
            assert {i for batch in mine for i in batch} == set(ids), heard
            # One NOTIFY when the sessions ended within the 50 ms a watcher waits for
            # its target's siblings; a host too loaded to end them that close may
            # split the news in two, never more.
            assert len(mine) == 1 if sent[-1] - sent[0] < 0.040 else len(mine) <= 2, (heard, sent)
        finally:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()
            await listener.close()
