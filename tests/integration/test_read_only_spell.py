"""A database that takes no writes for a while, and then does again, under every
background loop of pgcoord at once (an Elector, a Member with a member Lease,
Partitions, a Scheduler): what an operator reads in the log, and what the server
sees meanwhile. The spell is made the way a demotion is met by the clients: the
database's default becomes read-only and every session is ended (Patroni restarts
a demoted primary), then the default is reset and every session ended again."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pgcoord
from pgcoord._core import readonly
from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique

pytestmark = pytest.mark.asyncio

NO_WRITES = "the database takes no writes now"
WRITES_AGAIN = "the database takes writes again"


def spell(dsn: str, on: bool) -> None:
    dbname = dsn.rsplit("/", 1)[1]
    verb = "SET default_transaction_read_only = on" if on else "RESET default_transaction_read_only"
    with psycopg.connect(dsn, autocommit=True, options="-c default_transaction_read_only=off") as conn:
        conn.execute(f'ALTER DATABASE "{dbname}" {verb}')
        conn.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                     " where datname = current_database() and pid <> pg_backend_pid()")


def xacts(dsn: str) -> int:
    [(version,)] = sql(dsn, "show server_version_num")
    if int(str(version)) >= 150000:
        sql(dsn, "select pg_stat_force_next_flush()")
    else:  # PostgreSQL 14's backends report to the stats collector every 500 ms
        time.sleep(0.6)
    [(n,)] = sql(dsn, "select xact_commit + xact_rollback from pg_stat_database"
                      " where datname = current_database()")
    return int(str(n))


class Notices(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


async def test_two_read_only_spells_under_every_loop(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The notice is per process: start from a writable state.
    monkeypatch.setattr(readonly, "_since", None)
    monkeypatch.setattr(readonly, "_failing", {})
    handler = Notices()
    logger = logging.getLogger("pgcoord")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    prefix = unique("ro")
    ttl = 3.0
    seen: dict[str, Any] = {"slots": [], "own": 0, "lead": 0}
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=4, open=False, kwargs={"autocommit": True},
                               timeout=5)
    await pool.open()
    member = pgcoord.Member(dsn, group=prefix, name="m", ttl=ttl)
    await member.open()
    elector = pgcoord.Elector(dsn, f"{prefix}:e", ttl=ttl, holder="me")
    parts = pgcoord.Partitions(member, f"{prefix}:parts", count=2)
    sched = Scheduler(pool, runner="me", tick=0.2)

    @sched.cron(f"{prefix}:job", "* * * * * *", on_crash="skip", catch_up="latest", claim_ttl=ttl)
    async def job(slot: Slot) -> None:
        seen["slots"].append(slot.at)

    async def lead(fence: int) -> None:
        seen["lead"] += 1
        await asyncio.Event().wait()

    async def own(part: pgcoord.Partition) -> None:
        seen["own"] += 1
        await asyncio.Event().wait()

    async def mlease() -> None:
        while True:
            try:
                async with pgcoord.Lease(pool, f"{prefix}:ml", ttl=ttl, holder="me", member=member):
                    await asyncio.Event().wait()
            except Exception:
                await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(c) for c in (elector.run(lead), parts.run(own), sched.run(), mlease())]
    timeline: list[tuple[str, float, float, list[str]]] = []
    try:
        await asyncio.sleep(2)
        for round_ in range(2):
            handler.records.clear()
            spell(dsn, on=True)
            await asyncio.sleep(2)  # let every loop meet it
            before, t0 = xacts(dsn), time.monotonic()

            await asyncio.sleep(4)
            rate = (xacts(dsn) - before) / (time.monotonic() - t0)
            during = handler.warnings()
            handler.records.clear()
            slots_before = len(seen["slots"])
            spell(dsn, on=False)
            t_off = time.monotonic()
            while len(seen["slots"]) == slots_before and time.monotonic() - t_off < 15:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            resumed = time.monotonic() - t_off
            await asyncio.sleep(2)
            after = handler.warnings()
            timeline.append((f"round {round_}", rate, resumed, [*during, "--", *after]))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await member.close()
        await pool.close()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        spell(dsn, on=False)  # the database is the session's: leave it writable
    for name, rate, resumed, warnings in timeline:
        during, after = warnings[:warnings.index("--")], warnings[warnings.index("--") + 1:]
        # One notice for the spell, re-armed for the second one; never "writes again"
        # while it lasts (an elector on its own session keeps writing: pgcoord's
        # sessions set the default off for themselves, the pool's connections do not).
        assert sum(w.startswith(NO_WRITES) for w in during) == 1, (name, during)
        assert not any(w.startswith(WRITES_AGAIN) for w in during), (name, during)
        # No retry of any loop says it again at WARNING.
        assert not [w for w in during if "25006" in w and not w.startswith(NO_WRITES)], (name, during)
        assert sum(w.startswith(WRITES_AGAIN) for w in after) == 1, (name, after)
        assert not any(w.startswith(NO_WRITES) for w in after), (name, after)
        assert rate < 100, (name, rate)  # backing off, not spinning
        assert resumed < 10, (name, resumed)  # a slot ran soon after the spell
