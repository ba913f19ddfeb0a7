"""Elector under hostile conditions (issue 11): a resign that hangs, a pause past the
trust window, a session terminated under the leader, and a server that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgcoord
import pgcoord.migrations
from pgcoord.elector import elector as elector_module
from pgcoord._core.embedded import EmbeddedServer

from .conftest import sql, unique
from .converted_cancel import Converting

DRIVERS = ["asyncpg", "psycopg"]


async def until(predicate: Any, timeout: float, step: float = 0.002) -> float:  # noqa: ASYNC109
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)
    return time.monotonic() - started


@pytest.fixture
def short_resign(monkeypatch: pytest.MonkeyPatch) -> float:
    bound = 0.5
    monkeypatch.setattr(elector_module, "RESIGN_TIMEOUT", bound, raising=False)
    monkeypatch.setattr(elector_module, "CLEANUP_TIMEOUT", bound, raising=False)
    return bound


class Terms:
    """lead() that records its terms; the first one can be told to end early."""

    def __init__(self) -> None:
        self.fences: list[int] = []
        self.running = 0
        self.most_at_once = 0
        self.end_first: asyncio.Event | None = None

    async def lead(self, fence: int) -> None:
        self.fences.append(fence)
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            if len(self.fences) == 1 and self.end_first is not None:
                await self.end_first.wait()
                return
            await asyncio.sleep(3600)
        finally:
            self.running -= 1


# -- a resign that hangs ------------------------------------------------------------------------

@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_hung_resign_gives_up_at_its_bound_and_the_elector_leads_again(
    driver: str, dsn: str, short_resign: float,
) -> None:
    """Issue 11 item 3: the resign waits on a row another session holds FOR SHARE. It
    gives up at its bound, the elector keeps campaigning, and it leads again."""
    name = unique("elector:hung-resign")
    terms = Terms()
    terms.end_first = asyncio.Event()
    elector = pgcoord.Elector(dsn, name, ttl=2.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    blocker = None
    try:
        await until(lambda: elector.is_leader and terms.fences, 10)
        fence = terms.fences[0]
        blocker = psycopg.connect(dsn)
        pgcoord.check_fence(blocker, name, fence)  # the row is FOR SHARE until blocker ends
        terms.end_first.set()  # lead() returns: the elector resigns, and the resign hangs
        await until(lambda: not elector.is_leader, 2)
        await asyncio.sleep(short_resign + 1.0)
        assert not task.done(), task
        blocker.rollback()
        await until(lambda: len(terms.fences) == 2, 10)
        assert terms.fences[1] == fence + 1 and elector.is_leader
    finally:
        if blocker is not None:
            blocker.close()
        await elector.stop()
    await task  # ended by stop(), normally


@pytest.mark.parametrize("driver", DRIVERS)
async def test_stop_during_a_hung_resign_returns_at_the_bound(
    driver: str, dsn: str, short_resign: float,
) -> None:
    name = unique("elector:hung-stop")
    terms = Terms()
    elector = pgcoord.Elector(dsn, name, ttl=2.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    blocker = None
    try:
        await until(lambda: elector.is_leader and terms.fences, 10)
        blocker = psycopg.connect(dsn)
        pgcoord.check_fence(blocker, name, terms.fences[0])
        started = time.monotonic()
        await elector.stop()
        assert time.monotonic() - started < short_resign + 1.5
        await task  # run() ended normally: no CancelledError nobody asked for
        waiting = sql(dsn, "select count(*) from pg_stat_activity where wait_event_type = 'Lock'"
                           " and datname = current_database()")
        assert waiting == [(0,)]  # the server stopped waiting too (the session is gone)
    finally:
        if blocker is not None:
            blocker.close()
        await elector.stop()


async def test_lead_that_ignores_cancellation_does_not_hold_up_the_handover(
    dsn: str, short_resign: float,
) -> None:
    """A lead() that outlives its cancellation is left behind at the bound: the lease
    is released so a follower takes over, and this replica starts no second lead()
    while the first still runs."""
    name = unique("elector:stubborn")
    release_stubborn = asyncio.Event()
    stubborn_terms: list[int] = []
    running = 0
    most = 0

    async def stubborn(fence: int) -> None:
        nonlocal running, most
        stubborn_terms.append(fence)
        running += 1
        most = max(most, running)
        cancelled = False
        try:
            while True:
                try:
                    if cancelled:
                        await release_stubborn.wait()
                        raise asyncio.CancelledError
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if release_stubborn.is_set():
                        raise
                    cancelled = True  # this one and every one after it, ignored
        finally:
            running -= 1

    first = pgcoord.Elector(dsn, name, ttl=2.0, holder="stubborn")
    first_task = asyncio.create_task(first.run(stubborn))
    await until(lambda: first.is_leader, 10)
    follower_terms = Terms()
    follower = pgcoord.Elector(dsn, name, ttl=2.0, holder="follower")
    follower_task = asyncio.create_task(follower.run(follower_terms.lead))
    try:
        await asyncio.sleep(0.3)
        # The leader's session dies: lead() is cancelled, and ignores it.
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("select pg_terminate_backend(%s)",
                          (first._conn.backend_pid,))  # type: ignore[union-attr]
        await until(lambda: follower.is_leader, 5)
        await follower.stop()
        await asyncio.sleep(1.0)
        assert most == 1 and len(stubborn_terms) == 1  # no second term beside the first
        release_stubborn.set()
        await until(lambda: len(stubborn_terms) == 2, 10)  # campaigns and leads again
    finally:
        release_stubborn.set()
        await first.stop()
        await follower.stop()
    await first_task
    await follower_task


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_lead_that_takes_its_cancellation_for_an_error_is_cancelled_again(
    driver: str, dsn: str,
) -> None:
    """What the failover test caught (test_ha.py): lead() retries its fenced writes on
    database errors, and its driver turned the elector's cancellation into one.
    psycopg does that when a connection breaks during a cancelled statement (its
    AsyncConnection.wait() sends a cancel, waits for the statement, and raises
    OperationalError), as a failover breaks every connection at the moment the
    elector's session is lost. lead() below turns its first cancellation into that
    error, as psycopg would; the elector asks again, so it ends at once rather than
    at the 5 s bound, still leading as far as it knows."""
    lead = Converting()

    elector = pgcoord.Elector(dsn, unique("elector:retrying"), ttl=2.0, driver=driver)
    task = asyncio.create_task(elector.run(lead))
    try:
        await until(lambda: elector.is_leader and lead.starts, 10)
        with psycopg.connect(dsn, autocommit=True) as admin:
            lost_at = time.monotonic()
            admin.execute("select pg_terminate_backend(%s)",
                          (elector._conn.backend_pid,))  # type: ignore[union-attr]
        await until(lambda: lead.ended, 6)
        assert lead.errors == 1  # the first cancellation was taken for an error
        assert lead.ended[0] - lost_at < 2.0, "lead() ran on until the elector's bound"
    finally:
        await elector.stop()
    await task


async def test_a_graceful_stop_leaves_leads_cleanup_the_rest_of_the_trust_window(dsn: str) -> None:
    """Cancelled again only once the window has closed: on stop() the lease is still
    ours, so a cleanup in lead() that takes a moment is not cut short."""
    cleaned: list[int] = []

    async def lead(fence: int) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.3)  # e.g. flushing what this term wrote
            cleaned.append(fence)

    elector = pgcoord.Elector(dsn, unique("elector:cleanup"), ttl=4.0)
    task = asyncio.create_task(elector.run(lead))
    try:
        await until(lambda: elector.is_leader, 10)
        await asyncio.sleep(0.1)
    finally:
        await elector.stop()
    await task
    assert len(cleaned) == 1


async def test_a_graceful_stop_still_ends_a_lead_that_takes_its_cancellation_for_an_error(
    dsn: str,
) -> None:
    """At the default ttl the trust window outlasts the 5 s bound after which the lease
    is released anyway: lead() is cancelled again from halfway to the bound, so it has
    ended before the row is given up, not beside the next leader."""
    name = unique("elector:graceful-retrying")
    holder_when_ended: list[Any] = []
    lead = Converting(on_end=lambda: holder_when_ended.extend(
        sql(dsn, "select holder from pgcoord.leases where name = %s", name)))

    elector = pgcoord.Elector(dsn, name, ttl=10.0, holder="graceful")
    task = asyncio.create_task(elector.run(lead))
    try:
        await until(lambda: elector.is_leader, 10)
        asked = time.monotonic()
    finally:
        await elector.stop()
    stopped = time.monotonic()
    await task
    assert lead.errors == 1 and lead.ended, "lead() was never stopped"
    assert lead.ended[0] - asked < elector_module.LEAD_EXIT_TIMEOUT - 1.0, "ended only at the bound"
    # The lease was still this replica's when lead() ended: released only after it.
    assert holder_when_ended == [("graceful",)]
    assert stopped >= lead.ended[0]


# -- beliefs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("driver", DRIVERS)
async def test_is_leader_reads_false_the_moment_a_pause_outlives_the_trust_window(
    driver: str, dsn: str,
) -> None:
    """Issue 11 item 10: after a SIGSTOP past the window, is_leader must not read True
    for a loop turn on resume."""
    terms = Terms()
    elector = pgcoord.Elector(dsn, unique("elector:pause"), ttl=1.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    try:
        await until(lambda: elector.is_leader and terms.fences, 10)
        assert elector.fence == terms.fences[0]
        time.sleep(1.2)  # noqa: ASYNC251 - the event loop stops, as under SIGSTOP or a GC pause
        assert not elector.is_leader
        assert elector.fence is None
        await until(lambda: len(terms.fences) == 2 and elector.is_leader, 10)  # leads again
    finally:
        await elector.stop()
    await task


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_terminated_session_ends_the_leaders_belief_at_once(driver: str, dsn: str) -> None:
    """The elector reacts to the connection's on_lost at once, whatever the driver:
    with a ttl of 3 s the next renewal would be a second away."""
    terms = Terms()
    elector = pgcoord.Elector(dsn, unique("elector:terminated"), ttl=3.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    try:
        took = []
        for _ in range(3):
            await until(lambda: elector.is_leader, 10)
            await asyncio.sleep(0.2)
            pid = elector._conn.backend_pid  # type: ignore[union-attr]
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("select pg_terminate_backend(%s)", (pid,))
            took.append(await until(lambda: not elector.is_leader, 3))
            await until(lambda: terms.running == 0, 1)  # lead() was cancelled as well
        assert max(took) < 0.15, took
    finally:
        await elector.stop()
    await task


# -- the server goes away ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    # synchronous_commit on: an immediate shutdown must not lose committed lease rows.
    with EmbeddedServer({"synchronous_commit": "on"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


@pytest.mark.parametrize("driver", DRIVERS)
async def test_an_elector_keeps_campaigning_across_restarts_and_an_outage(
    driver: str, own_server: EmbeddedServer,
) -> None:
    """Background loops survive the database: a restart, and an outage of several ttls,
    never end run(); the elector leads again once the server is back."""
    terms = Terms()
    elector = pgcoord.Elector(own_server.dsn, unique("elector:restart"), ttl=1.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    try:
        await until(lambda: elector.is_leader, 10)
        await asyncio.to_thread(own_server.restart)
        await until(lambda: len(terms.fences) == 2 and elector.is_leader, 15)
        assert terms.fences[1] == terms.fences[0] + 1
        # Down for three ttls: campaigning fails on and on, and carries on.
        own_server._shutdown(signal.SIGQUIT)
        await until(lambda: not elector.is_leader, 2)
        await asyncio.sleep(3.0)
        assert not task.done()
        await asyncio.to_thread(own_server._spawn)
        await until(lambda: len(terms.fences) == 3 and elector.is_leader, 15)
        assert terms.most_at_once == 1
    finally:
        await elector.stop()
    await task


def _server_processes(server: EmbeddedServer) -> list[int]:
    """The postmaster and its children (each backend is a session of its own, so
    signalling the postmaster's process group would reach the postmaster only)."""
    assert server._proc is not None
    postmaster = server._proc.pid
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                # pid (comm) state ppid ...: comm may hold spaces, so split after ")"
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(entry))
    return pids


@contextlib.contextmanager
def frozen(server: EmbeddedServer) -> Iterator[None]:
    """The whole server stops answering (postmaster and backends), as in a partition
    or a hung host: connections stay open, nothing comes back."""
    pids = _server_processes(server)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in _server_processes(server):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_frozen_server_costs_the_leadership_but_not_the_campaign(
    driver: str, own_server: EmbeddedServer, short_resign: float,
) -> None:
    """The leader steps down when its trust window closes; its resign cannot reach the
    server and is abandoned at its bound; run() carries on and leads again after."""
    terms = Terms()
    elector = pgcoord.Elector(own_server.dsn, unique("elector:frozen"), ttl=1.0, driver=driver)
    task = asyncio.create_task(elector.run(terms.lead))
    try:
        await until(lambda: elector.is_leader and terms.fences, 10)
        with frozen(own_server):
            await until(lambda: not elector.is_leader, 2)
            await until(lambda: terms.running == 0, 2)
            await asyncio.sleep(short_resign + 1.5)
            assert not task.done(), task
        await until(lambda: len(terms.fences) == 2 and elector.is_leader, 30)
        assert terms.fences[1] == terms.fences[0] + 1
    finally:
        await elector.stop()
    await task


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_follower_keeps_campaigning_across_a_restart(
    driver: str, own_server: EmbeddedServer,
) -> None:
    name = unique("elector:follower-restart")
    leader_terms, follower_terms = Terms(), Terms()
    leader = pgcoord.Elector(own_server.dsn, name, ttl=1.0, holder="leader", driver=driver)
    leader_task = asyncio.create_task(leader.run(leader_terms.lead))
    await until(lambda: leader.is_leader, 10)
    follower = pgcoord.Elector(own_server.dsn, name, ttl=1.0, holder="follower", driver=driver)
    follower_task = asyncio.create_task(follower.run(follower_terms.lead))
    try:
        await asyncio.sleep(0.3)  # the follower waits on the doorbell
        await asyncio.to_thread(own_server.restart)
        await until(lambda: leader.is_leader or follower.is_leader, 15)
        await asyncio.sleep(0.5)
        current = leader if leader.is_leader else follower
        other = follower if current is leader else leader
        await current.stop()
        await until(lambda: other.is_leader, 5)  # the other was still campaigning
    finally:
        await leader.stop()
        await follower.stop()
    await leader_task
    await follower_task
