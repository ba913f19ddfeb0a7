"""Scheduler under hostile conditions (issue 11): a record that blocks past its bound,
a claim whose renewals fail, long outages, other session time zones, lock-name growth,
bare connections and one-connection pools.

Restarts and terminated sessions are in test_scheduler_restarts.py (they need a server
of their own)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import psycopg_pool
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

import pgcoord
from pgcoord import scheduler as scheduler_module
from pgcoord._drivers import run_statement
from pgcoord.scheduler import Scheduler, Slot

from .conftest import setting_seconds, sql, unique
from .converted_cancel import Converting
from .sources import ASYNC_CONNS, open_async
from .test_scheduler import plant_crashed_claim, register_in_the_past, run_for, slot_rows

UTC = dt.UTC


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=2, max_size=6)
    yield p
    await p.close()


class HeldRow:
    """Another session that holds one job_slots row FOR UPDATE, so that every write
    to it (a record, a heartbeat) waits for this transaction."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.claim_expires_at: dt.datetime | None = None

    async def hold(self, job: str, at: dt.datetime) -> None:
        self.conn = await psycopg.AsyncConnection.connect(self.dsn)
        cur = await self.conn.execute(
            "select claim_expires_at from pgcoord.job_slots where job = %s and slot_at = %s"
            " for update", (job, at))
        row = await cur.fetchone()
        assert row is not None
        self.claim_expires_at = row[0]

    async def release(self) -> None:
        if self.conn is not None:
            await self.conn.rollback()
            await self.conn.close()
            self.conn = None


class Tasks:
    """Every task created from now on in this loop (names are set after the factory)."""

    def __init__(self) -> None:
        self.created: list[asyncio.Task[Any]] = []

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            task = asyncio.Task(coro, loop=loop, **kwargs)
            self.created.append(task)
            return task

        asyncio.get_running_loop().set_task_factory(factory)  # the test's own loop

    def cancelled(self, prefix: str) -> list[asyncio.Task[Any]]:
        return [t for t in self.created
                if t.get_name().startswith(prefix) and t.done() and t.cancelled()]


# -- 1. a record that blocks past its bound -----------------------------------------------


async def test_trigger_returns_when_its_record_blocks_past_the_bound(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """The record of a slot's outcome waits on a row lock for longer than its 5 s bound:
    trigger() gets its own outcome after the bound, never a CancelledError."""
    job = unique("record-blocked")
    held = HeldRow(dsn)
    s = Scheduler(pool)

    @s.cron(job, "0 0 1 1 *")
    async def work(slot: Slot) -> None:
        await held.hold(slot.job, slot.at)

    started = time.monotonic()
    try:
        slot = await s.trigger(job)  # raised a bare CancelledError before the fix
        took = time.monotonic() - started
        # A lock_timeout shorter than the bound (the settings suite's) ends the record's
        # wait sooner, with the same outcome.
        lock_timeout = setting_seconds(dsn, "lock_timeout")
        low = 4.0 if lock_timeout is None else min(4.0, lock_timeout - 0.5)
        assert low < took < 7.5, took
        await asyncio.sleep(8.0 - took)  # the row stays locked past the bound
    finally:
        await held.release()
    # The record was abandoned (its statement cancelled): the row is still the claim.
    assert sql(dsn, "select state from pgcoord.job_slots where job = %s and slot_at = %s",
               job, slot.at) == [("running",)]


async def test_run_goes_on_when_a_record_blocks_past_the_bound(
    dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture,
) -> None:
    job = unique("record-blocked-run")
    held = HeldRow(dsn)
    blocked: list[dt.datetime] = []
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", allow_overlap=True)
    async def work(slot: Slot) -> None:
        if not blocked:
            blocked.append(slot.at)
            await held.hold(slot.job, slot.at)

    caplog.set_level(logging.WARNING, logger="pgcoord")
    tasks = Tasks()
    task = asyncio.create_task(s.run())
    try:
        await asyncio.sleep(7.5)
        assert not task.done(), task
        # No run ended in a CancelledError that nobody asked for.
        assert tasks.cancelled("pgcoord-job:") == []
    finally:
        await held.release()
        await s.stop()
    await task  # returns normally
    rows = slot_rows(dsn, job)
    later = [r for r in rows if r[0] > blocked[0] and r[1] == "succeeded"]
    assert len(later) >= 5, rows  # slots went on running while the record was stuck
    assert any("could not record" in r.getMessage() or "abandoned" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


# -- 2. a claim's trust window --------------------------------------------------------------


async def test_a_retry_runner_stops_believing_before_its_claim_expires(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """Renewals of a running retry slot block (another session holds the row): the body is
    cancelled when the trust window closes, before the claim expires in the database; the
    next attempt runs elsewhere, and the first runner records nothing."""
    job = unique("trust-window")
    slot_at = plant_crashed_claim(dsn, job, "0 0 1 1 *")
    held = HeldRow(dsn)
    started = asyncio.Event()
    cancelled_at: list[float] = []
    finished: list[str] = []

    first = Scheduler(pool, runner="first")

    @first.cron(job, "0 0 1 1 *", on_crash="retry", max_attempts=5, claim_ttl=3.0)
    async def slow(slot: Slot) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled_at.append(time.time())
            raise
        finished.append("first")

    task = asyncio.create_task(first.run())
    try:
        await asyncio.wait_for(started.wait(), 10)
        await held.hold(job, slot_at)
        assert held.claim_expires_at is not None
        for _ in range(100):
            if cancelled_at:
                break
            await asyncio.sleep(0.1)
        assert cancelled_at, "the body went on although its claim could not be renewed"
        assert cancelled_at[0] < held.claim_expires_at.timestamp()
        await first.stop()
        await task
    finally:
        await held.release()
    assert sql(dsn, "select state, attempt, runner from pgcoord.job_slots"
                    " where job = %s and slot_at = %s", job, slot_at) == [("running", 2, "first")]

    second = Scheduler(pool, runner="second")

    @second.cron(job, "0 0 1 1 *", on_crash="retry", max_attempts=5, claim_ttl=3.0)
    async def quick(slot: Slot) -> None:
        finished.append(f"second:{slot.attempt}")

    await run_for(4.0, second)
    assert finished == ["second:3"]
    assert sql(dsn, "select state, attempt, runner from pgcoord.job_slots"
                    " where job = %s and slot_at = %s", job, slot_at) == [("succeeded", 3, "second")]


async def test_a_body_that_takes_its_cancellation_for_an_error_is_cut_off_in_time(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """The body retries on database errors, and the cancellation that cuts it off
    comes back as one (psycopg raises OperationalError when the connection breaks
    during a cancelled statement). The heartbeat cancels it again until it ends,
    before the claim expires and another runner may start the slot."""
    job = unique("recancel")
    slot_at = plant_crashed_claim(dsn, job, "0 0 1 1 *")
    held = HeldRow(dsn)
    started = asyncio.Event()
    ended_at: list[float] = []  # unix time, to compare with the claim's expiry
    body = Converting(on_end=lambda: ended_at.append(time.time()))
    s = Scheduler(pool, runner="first")

    # claim_ttl 6 s: the trust margin (0.6 s) leaves room for the 0.1 s re-cancel and
    # a loaded machine's event loop lag before the claim expires.
    @s.cron(job, "0 0 1 1 *", on_crash="retry", max_attempts=5, claim_ttl=6.0)
    async def retrying(slot: Slot) -> None:
        started.set()
        await body(slot)

    task = asyncio.create_task(s.run())
    try:
        await asyncio.wait_for(started.wait(), 10)
        await held.hold(job, slot_at)
        assert held.claim_expires_at is not None
        for _ in range(150):
            if ended_at:
                break
            await asyncio.sleep(0.1)
        assert ended_at and body.errors == 1, "the body went on after its claim was lost"
        assert ended_at[0] < held.claim_expires_at.timestamp()
        await s.stop()
        await task
    finally:
        await held.release()


async def test_stop_ends_a_body_that_takes_its_cancellation_for_an_error(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    """On stop() the body's cleanup has a moment while the claim is still ours, then it
    is cancelled again: one whose driver turned the cancellation into an error it
    retries on has ended well before the stop's bound (after which nobody would renew
    its claim while it ran on)."""
    job = unique("recancel-stop")
    started = asyncio.Event()
    body = Converting()
    s = Scheduler(pool, runner="stopping")

    @s.cron(job, "* * * * * *", claim_ttl=30.0)
    async def retrying(slot: Slot) -> None:
        started.set()
        await body(slot)

    task = asyncio.create_task(s.run())
    await asyncio.wait_for(started.wait(), 10)
    asked = time.monotonic()
    await s.stop(drain=0)
    await task
    assert body.errors == 1 and body.ended, "the body was never stopped"
    assert body.ended[0] - asked < 5.0
    assert sql(dsn, "select state from pgcoord.job_slots where job = %s and state = 'running'", job) == []


async def test_a_transactional_retry_runner_rolls_back_when_its_claim_is_lost(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    sql(dsn, "create table if not exists tx_effects (job text, slot_at timestamptz)")
    job = unique("trust-window-tx")
    slot_at = plant_crashed_claim(dsn, job, "0 0 1 1 *")
    held = HeldRow(dsn)
    wrote = asyncio.Event()
    s = Scheduler(pool, runner="first")

    @s.cron(job, "0 0 1 1 *", on_crash="retry", claim_ttl=3.0, transactional=True)
    async def work(slot: Slot) -> None:
        await slot.conn.execute("insert into tx_effects values ($1, $2)", slot.job, slot.at)
        wrote.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(s.run())
    try:
        await asyncio.wait_for(wrote.wait(), 10)
        await held.hold(job, slot_at)
        assert held.claim_expires_at is not None
        deadline = held.claim_expires_at.timestamp()
        # The run is cut off (its transaction rolled back, its lock released) in time.
        for _ in range(200):
            if time.time() >= deadline or not pgcoord_locks(dsn, job):
                break
            await asyncio.sleep(0.05)
        assert time.time() < deadline, "still running when the claim expired"
        await s.stop()
        await task
    finally:
        await held.release()
    assert sql(dsn, "select count(*) from tx_effects where job = %s", job) == [(0,)]


def pgcoord_locks(dsn: str, job: str) -> list[tuple[Any, ...]]:
    """Advisory locks held by sessions running a slot of ``job`` (by its transaction)."""
    return sql(dsn, "select l.pid from pg_locks l join pg_stat_activity a using (pid)"
                    " where l.locktype = 'advisory' and a.query like %s", "%tx_effects%")


# -- 3. catch-up, time zones, lock names ---------------------------------------------------


async def test_catch_up_latest_after_a_40_hour_outage_runs_the_latest_slot(
    dsn: str, pool: asyncpg.Pool,
) -> None:
    job = unique("outage")
    register_in_the_past(dsn, job, "* * * * *", 40 * 3600)
    ran: list[dt.datetime] = []
    s = Scheduler(pool)

    @s.cron(job, "* * * * *")
    async def work(slot: Slot) -> None:
        ran.append(slot.at)

    [(before,)] = sql(dsn, "select clock_timestamp()")
    await run_for(3.0, s)
    assert isinstance(before, dt.datetime)
    # The first run is the latest slot that was due, not one hours old; a minute
    # that begins during the test runs on time after it.
    assert ran and before - dt.timedelta(seconds=60) < ran[0] <= before + dt.timedelta(seconds=1), (
        before, ran)
    assert ran[1:] in ([], [ran[0] + dt.timedelta(minutes=1)]), ran
    rows = slot_rows(dsn, job)
    minutes = [int(r[0].timestamp()) // 60 for r in rows]
    assert minutes == list(range(minutes[0], minutes[-1] + 1)), "a slot has no row"
    assert len(rows) >= 40 * 60
    first_run = [r[0] for r in rows].index(ran[0])
    assert [r[1] for r in rows[:first_run]] == ["missed"] * first_run
    assert [r[1] for r in rows[first_run:]] == ["succeeded"] * len(ran)


POOLS = ["asyncpg-pool", "psycopg-pool", "sa-async-asyncpg", "sa-async-psycopg"]


@contextlib.asynccontextmanager
async def open_pool(kind: str, dsn: str, *, size: int = 4,
                    timezone: str | None = None) -> AsyncIterator[Any]:
    """A pool of at most ``size`` connections (SQLAlchemy without overflow), whose
    sessions use ``timezone`` when given."""
    if kind == "asyncpg-pool":
        settings = {"timezone": timezone} if timezone else {}
        apool = await asyncpg.create_pool(dsn, min_size=1, max_size=size, server_settings=settings)
        try:
            yield apool
        finally:
            await apool.close()
    elif kind == "psycopg-pool":
        kwargs = {"options": f"-c TimeZone={timezone}"} if timezone else {}
        async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=size, open=False,
                                                    kwargs=kwargs) as ppool:
            yield ppool
    else:
        driver = kind.rpartition("-")[2]
        args: dict[str, Any] = {}
        if timezone:
            args = ({"server_settings": {"timezone": timezone}} if driver == "asyncpg"
                    else {"options": f"-c TimeZone={timezone}"})
        engine = create_async_engine(dsn.replace("postgresql://", f"postgresql+{driver}://"),
                                     pool_size=size, max_overflow=0, connect_args=args)
        try:
            yield engine
        finally:
            await engine.dispose()


@pytest.mark.parametrize("kind", POOLS)
async def test_slot_at_is_utc_whatever_the_session_time_zone(dsn: str, kind: str) -> None:
    job, retried = unique("tz"), unique("tz-retry")
    planted = plant_crashed_claim(dsn, retried, "0 0 1 1 *")
    seen: list[Slot] = []

    async def remember(slot: Slot) -> None:
        seen.append(slot)

    async with open_pool(kind, dsn, timezone="Asia/Kolkata") as source:
        assert await run_statement(source, "select current_setting('TimeZone')", ()) == (
            "Asia/Kolkata",)
        s = Scheduler(source)
        s.cron(job, "* * * * * *")(remember)
        s.cron(retried, "0 0 1 1 *", on_crash="retry")(remember)
        manual = await s.trigger(job)
        await run_for(1.5, s)
    assert manual.manual and seen[0].at == manual.at
    assert [slot.at for slot in seen if slot.job == retried] == [planted]
    assert any(slot.job == job and not slot.manual for slot in seen)
    for slot in [manual, *seen]:
        assert slot.at.tzinfo is UTC, (slot, slot.at.tzinfo)
        assert slot.key.endswith("Z")


async def test_a_transactional_job_adds_at_most_one_lock_name(dsn: str, pool: asyncpg.Pool) -> None:
    from prometheus_client import REGISTRY

    job = unique("tx-names")
    s = Scheduler(pool)

    @s.cron(job, "* * * * * *", transactional=True)
    async def work(slot: Slot) -> None:
        await slot.conn.execute("select 1")

    await run_for(3.5, s)
    assert len([r for r in slot_rows(dsn, job) if r[1] == "succeeded"]) >= 3
    assert len(sql(dsn, "select name from pgcoord.lock_names where name like %s",
                   f"%{job}%")) <= 1
    labels = {sample.labels["name"] for metric in REGISTRY.collect()
              for sample in metric.samples if job in sample.labels.get("name", "")}
    assert len(labels) <= 1, labels


# -- 4. bare connections --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ASYNC_CONNS)
async def test_a_bare_connection_is_refused(dsn: str, kind: str) -> None:
    async with open_async(kind, dsn) as conn:
        with pytest.raises(pgcoord.UnsupportedConnection, match="Scheduler"):
            Scheduler(conn)


async def test_an_engine_that_shares_one_connection_is_refused(dsn: str) -> None:
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"),
                                 poolclass=StaticPool)
    try:
        with pytest.raises(pgcoord.UnsupportedConnection, match="StaticPool"):
            Scheduler(engine)
    finally:
        await engine.dispose()


# -- 5. small pools -------------------------------------------------------------------------


async def _noop(slot: Slot) -> None:
    pass


@pytest.mark.parametrize("kind", POOLS)
async def test_a_one_connection_pool_runs_jobs_and_refuses_transactional_ones_at_once(
    dsn: str, kind: str,
) -> None:
    slow, quick = unique("small-slow"), unique("small-quick")

    async def longer_than_the_claim(slot: Slot) -> None:
        await asyncio.sleep(1.5)

    async with open_pool(kind, dsn, size=1) as source:
        assert scheduler_module.pool_capacity(source) == 1
        s = Scheduler(source)
        started = time.monotonic()
        with pytest.raises(pgcoord.PgcoordError, match="max_size"):
            s.cron(unique("small-tx"), "* * * * * *", transactional=True)
        assert time.monotonic() - started < 1.0
        # Heartbeats every 0.33 s share the one connection with the ticks and records.
        s.cron(slow, "* * * * * *", claim_ttl=1.0)(longer_than_the_claim)
        s.cron(quick, "* * * * * *")(_noop)
        await s.trigger(quick)
        await run_for(4.0, s)
    slow_rows, quick_rows = slot_rows(dsn, slow), slot_rows(dsn, quick)
    assert [r for r in slow_rows if r[1] == "succeeded"], slow_rows
    assert not [r for r in slow_rows if r[1] == "abandoned"], slow_rows
    assert len([r for r in quick_rows if r[1] == "succeeded"]) >= 3, quick_rows


@pytest.mark.parametrize("kind", POOLS)
async def test_a_two_connection_pool_keeps_one_for_heartbeats(dsn: str, kind: str) -> None:
    """Transactional runs hold a connection each: they take turns, so that claims
    (heartbeats every 0.3 s, longer runs) are always renewed."""
    jobs = [unique("pair-a"), unique("pair-b")]
    running = most = 0

    async def work(slot: Slot) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await asyncio.sleep(1.2)
        finally:
            running -= 1

    async with open_pool(kind, dsn, size=2) as source:
        s = Scheduler(source)
        for job in jobs:
            s.cron(job, "* * * * * *", transactional=True, claim_ttl=0.9)(work)
        await run_for(5.0, s)
    assert most == 1
    for job in jobs:
        rows = slot_rows(dsn, job)
        assert [r for r in rows if r[1] == "succeeded"], rows
        assert not [r for r in rows if r[1] == "abandoned" and r[2] != "stopped"], rows


async def test_pool_capacity_of_each_pool_type(dsn: str) -> None:
    """pool_capacity reads SQLAlchemy's QueuePool._max_overflow (private): this fails
    loudly if an installed SQLAlchemy keeps it elsewhere."""
    for kind in POOLS:
        async with open_pool(kind, dsn, size=3) as source:
            assert scheduler_module.pool_capacity(source) == 3, kind
    url = dsn.replace("postgresql://", "postgresql+asyncpg://")
    engines: list[AsyncEngine] = [
        create_async_engine(url, pool_size=2, max_overflow=3),
        create_async_engine(url, pool_size=2, max_overflow=-1),
        create_async_engine(url, pool_size=0),
    ]
    try:
        assert [scheduler_module.pool_capacity(e) for e in engines] == [5, None, None]
    finally:
        for e in engines:
            await e.dispose()
    async with psycopg_pool.AsyncNullConnectionPool(dsn, open=False) as unbounded, \
            psycopg_pool.AsyncNullConnectionPool(dsn, max_size=2, open=False) as two:
        assert scheduler_module.pool_capacity(unbounded) is None
        assert scheduler_module.pool_capacity(two) == 2
        Scheduler(unbounded).cron("any", "* * * * *", transactional=True)(_noop)
