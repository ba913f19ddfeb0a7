"""The members of one process share one listening session for membership news
(``pgcoord/member/news_hub.py``): ten watching members used to be ten sessions that
every NOTIFY in the database signalled. These tests hold the sharing to its promise:
one session listens, every member hears, and news outlives the session that carried
it (lost, terminated together with a dying peer, or no longer needing news)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest

import pgcoord

from .conftest import migrated_database

CHANNEL = "pgcoord_members"


async def until(check: object, timeout: float, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


async def listening(member: pgcoord.Member) -> list[str]:
    """What the member's main session LISTENs to, asked of that session itself."""
    return sorted(await member._call("SELECT coalesce(pg_catalog.array_agg(c), '{}')::text[] "
                                     "FROM pg_catalog.pg_listening_channels() AS c"))


class Watcher:
    """A member with a watch(), collecting the ids it is told have left."""

    def __init__(self, member: pgcoord.Member) -> None:
        self.member = member
        self.left: dict[int, str] = {}
        self._changes = member.watch()
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for change in self._changes:
            if isinstance(change, pgcoord.MemberLeft):
                self.left[change.member.id] = change.reason

    def close(self) -> None:
        self._changes.close()
        self._task.cancel()


@contextlib.asynccontextmanager
async def fleet(dsn: str, watchers: int, others: int = 1,
                trailing: int = 0, ttl: float = 3.0) -> AsyncIterator[tuple[list[Watcher], list[pgcoord.Member]]]:
    """``watchers`` members that watch, and ``others`` that do not (victims), in one
    group; ``trailing`` more that do not watch join last (the ring is ordered by id,
    so the last one watches the first)."""
    g = f"hub-{uuid.uuid4().hex[:6]}"
    async with contextlib.AsyncExitStack() as stack:
        plain = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=ttl)) for _ in range(others)]
        members = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=ttl))
                   for _ in range(watchers)]
        plain += [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=ttl)) for _ in range(trailing)]
        watching = [Watcher(m) for m in members]
        try:
            await until(lambda: all(m._hears_news for m in members)
                        and any(CHANNEL in m._listening for m in members), 5, "the watchers hear news")
            yield watching, plain
        finally:
            for w in watching:
                w.close()


def carriers(watching: list[Watcher]) -> list[pgcoord.Member]:
    return [w.member for w in watching if CHANNEL in w.member._listening]


def terminate(dsn: str, *pids: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pg_catalog.pg_terminate_backend(p) from unnest(%s::int[]) as p", (list(pids),))


async def test_the_watching_members_of_a_process_share_one_listening_session(dsn: str) -> None:
    async with fleet(dsn, watchers=4) as (watching, (victim,)):
        sessions = [await listening(w.member) for w in watching]
        assert sorted(sessions) == [[], [], [], [CHANNEL]], sessions
        assert len(carriers(watching)) == 1
        gone = victim.id
        assert victim._main is not None
        terminate(dsn, victim._main.backend_pid)
        await until(lambda: all(w.left.get(gone) == "crashed" for w in watching), 5,
                    "every watcher is told of the death")


async def test_news_go_on_when_the_carrier_s_session_is_lost(dsn: str) -> None:
    async with fleet(dsn, watchers=3) as (watching, (victim,)):
        (carrier,) = carriers(watching)
        assert carrier._main is not None
        terminate(dsn, carrier._main.backend_pid)
        others = [w for w in watching if w.member is not carrier]
        # Another member of the process listens instead, and only one does.
        await until(lambda: any(CHANNEL in w.member._listening for w in others), 5, "a new carrier")
        await until(lambda: carrier.has_session, 5, "the old carrier joins again")
        await asyncio.sleep(0.3)
        assert sum([await listening(w.member) == [CHANNEL] for w in watching]) == 1
        gone = victim.id
        assert victim._main is not None
        terminate(dsn, victim._main.backend_pid)
        await until(lambda: all(w.left.get(gone) == "crashed" for w in watching), 5,
                    "every watcher, the rejoined carrier too, is told")


async def test_a_death_while_the_news_change_hands_is_still_told(dsn: str) -> None:
    """The carrier and a peer end in one statement: the NOTIFY of the peer's death
    may go out before anyone listens again. The members read the group afresh once
    a new carrier listens, and are told then."""
    async with fleet(dsn, watchers=3) as (watching, (victim,)):
        (carrier,) = carriers(watching)
        others = [w for w in watching if w.member is not carrier]
        gone = victim.id
        assert carrier._main is not None and victim._main is not None
        terminate(dsn, carrier._main.backend_pid, victim._main.backend_pid)
        await until(lambda: all(w.left.get(gone) == "crashed" for w in others), 5,
                    "the others are told of the peer's death")


@pytest.fixture
def own_dsn(pg_server: Any) -> Iterator[str]:
    """A database of its own: nobody else there listens to membership news."""
    yield from migrated_database(pg_server, "pgcoord_hub")


async def test_news_sent_while_nobody_carries_them_are_caught_up(own_dsn: str) -> None:
    """The carrier's session ends, and its successor cannot LISTEN yet (the listeners'
    register is held: ``pgcoord.ears_open`` waits). A death told meanwhile reaches
    nobody in the process; once the new carrier listens, every member reads the group
    afresh and is told. (The victim's watcher, which tells its own member at once, is
    not one of the watching members: a member that joins after them.)"""
    # A long ttl: the next carrier's LISTEN waits 500 ms (its session's lock_timeout)
    # at each try, and its heartbeat queues behind; a short ttl's bound on that
    # heartbeat ended its session on a loaded host, and another member carried.
    async with fleet(own_dsn, watchers=3, trailing=1, ttl=10.0) as (watching, (victim, _)):
        (carrier,) = carriers(watching)
        others = [w for w in watching if w.member is not carrier]
        with psycopg.connect(own_dsn, autocommit=True) as register:
            register.execute("set lock_timeout = 0")  # the test's own wait, whatever the DBA set
            holding = asyncio.ensure_future(asyncio.to_thread(
                register.execute, "select pg_catalog.pg_advisory_lock(pgcoord.ears_ns(), "
                                  "pgcoord.ears_code('pgcoord_members'))"))
            await asyncio.sleep(0.2)
            assert not holding.done()  # the carrier's registration stands in the way
            assert carrier._main is not None and victim._main is not None
            terminate(own_dsn, carrier._main.backend_pid)
            await asyncio.wait_for(holding, 5)
            gone = victim.id
            terminate(own_dsn, victim._main.backend_pid)
            with psycopg.connect(own_dsn, autocommit=True) as look:
                await until(lambda: look.execute("select left_at is not null from pgcoord.member_sessions "
                                                 "where id = %s", (gone,)).fetchone() == (True,),
                            5, "the death is reaped")
            await asyncio.sleep(0.5)
            # The member chosen to carry next reads the group while it tries to LISTEN;
            # the one that merely hears (a bystander) has heard nothing.
            bystanders = [w for w in others if w.member is not carrier._hub.carrier]
            assert len(bystanders) == 1
            assert gone not in bystanders[0].left, "told while nobody listened?"
            register.execute("select pg_catalog.pg_advisory_unlock_all()")
        await until(lambda: all(gone in w.left for w in others), 5,
                    "the others are told once a new carrier listens")


async def test_a_carrier_that_no_longer_needs_news_hands_them_over(dsn: str) -> None:
    async with fleet(dsn, watchers=3) as (watching, (victim,)):
        first = next(w for w in watching if CHANNEL in w.member._listening)
        first.close()
        rest = [w for w in watching if w is not first]
        # At its next heartbeat (ttl/3) it lets go, and another member listens.
        await until(lambda: CHANNEL not in first.member._listening
                    and any(CHANNEL in w.member._listening for w in rest), 5, "handed over")
        assert await listening(first.member) == []
        gone = victim.id
        assert victim._main is not None
        terminate(dsn, victim._main.backend_pid)
        await until(lambda: all(w.left.get(gone) == "crashed" for w in rest), 5, "still told")

