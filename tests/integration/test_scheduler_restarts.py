"""Scheduler.run() survives the database (issue 11, item 7): every session of its pool
terminated, and a server restart, on every async pool type. It backs off, carries on,
and slots due after the outage run. The server is this module's own, so that a
restart does not cut other tests' sessions."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time
from collections.abc import Iterator

import pytest

import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer
from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique
from .test_scheduler_hostile import POOLS, open_pool


@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


def db_now(dsn: str) -> dt.datetime:
    [(now,)] = sql(dsn, "select clock_timestamp()")
    assert isinstance(now, dt.datetime)
    return now


async def wait_for_runs(dsn: str, job: str, after: dt.datetime, n: int, within: float) -> None:
    """Until ``n`` slots due after ``after`` have succeeded."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        rows = await asyncio.to_thread(
            sql, dsn, "select count(*) from pgcoord.job_slots where job = %s and slot_at > %s"
                      " and state = 'succeeded'", job, after)
        if rows[0][0] >= n:
            return
        assert loop.time() < deadline, f"fewer than {n} slots ran after {after} within {within} s"
        await asyncio.sleep(0.2)


def terminate_every_session(dsn: str) -> int:
    rows = sql(dsn, "select count(pg_terminate_backend(pid)) from pg_stat_activity"
                    " where datname = current_database() and pid <> pg_backend_pid()"
                    " and backend_type = 'client backend'")
    return int(rows[0][0])  # type: ignore[call-overload]


def restart_after_an_outage(server: EmbeddedServer, down: float) -> None:
    """An immediate shutdown (every session cut), ``down`` seconds with no server (so
    that every tick, heartbeat and connection attempt meets it), then a start."""
    server._shutdown(signal.SIGQUIT)
    time.sleep(down)
    server._spawn()


async def _noop(slot: Slot) -> None:
    pass


@pytest.mark.parametrize("kind", POOLS)
async def test_run_survives_terminated_sessions_and_a_server_restart(
    own_server: EmbeddedServer, kind: str,
) -> None:
    dsn = own_server.dsn
    job = unique("survive")
    async with open_pool(kind, dsn, size=3) as source:
        s = Scheduler(source)
        s.cron(job, "* * * * * *", claim_ttl=2.0)(_noop)
        task = asyncio.create_task(s.run())
        try:
            await wait_for_runs(dsn, job, db_now(dsn), 2, 15)

            cut = db_now(dsn)
            assert terminate_every_session(dsn) >= 1
            await wait_for_runs(dsn, job, cut, 2, 20)
            assert not task.done()

            await asyncio.to_thread(restart_after_an_outage, own_server, 3.0)
            restarted = db_now(dsn)
            await wait_for_runs(dsn, job, restarted, 2, 40)
            assert not task.done()
        finally:
            await s.stop()
        await task  # run() returns normally: the outages never ended it
