"""An elector's own session runs one statement at a time. A stop() that comes while
a renewal is in flight (it waits on the lease row) resigns once that renewal has
answered, on the same session: the lease is released, not left to its ttl, and no
"another operation is in progress" is ever raised (asyncpg's error for two
statements at once on one connection, seen on SIGTERM during a benchmark)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
import pytest

import pgcoord

from .conftest import sql, unique

DRIVERS = ["asyncpg", "psycopg"]


async def until(predicate: Any, timeout: float, step: float = 0.005) -> None:  # noqa: ASYNC109
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(step)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_stop_during_a_renewal_in_flight_resigns_after_it(
    driver: str, dsn: str, caplog: pytest.LogCaptureFixture,
) -> None:
    name = unique("elector:renewal-in-flight")
    app = f"pgcoord-el-{name[-8:]}"
    elector = pgcoord.Elector(dsn, name, ttl=3.0, driver=driver, application_name=app)

    async def lead(fence: int) -> None:
        await asyncio.sleep(3600)

    task = asyncio.create_task(elector.run(lead))
    blocker = psycopg.connect(dsn)
    try:
        await until(lambda: elector.is_leader, 10)
        # The row locked FOR UPDATE: the next renewal waits on it, in flight.
        blocker.execute("select 1 from pgcoord.leases where name = %s for update", (name,))

        def renewal_waits() -> bool:
            return bool(sql(dsn, "select count(*) from pg_stat_activity where application_name = %s"
                                 " and wait_event_type = 'Lock'", app)[0][0])

        deadline = time.monotonic() + 5
        while not renewal_waits():
            assert time.monotonic() < deadline, "the renewal never waited on the row"
            await asyncio.sleep(0.02)
        caplog.set_level(logging.INFO, logger="pgcoord")
        stopping = asyncio.create_task(elector.stop())
        await asyncio.sleep(0.3)  # stop() is under way while the renewal waits
        blocker.rollback()
        await asyncio.wait_for(stopping, 10)
        await task
    finally:
        blocker.close()
        await elector.stop()
    failed = [r.getMessage() for r in caplog.records if "resign failed" in r.getMessage()]
    assert failed == []
    # Released by the resign (not left to expire, not freed by a closed session).
    assert sql(dsn, "select holder from pgcoord.leases where name = %s", name) == [(None,)]
    assert sql(dsn, "select ended_how from pgcoord.lease_history where name = %s"
                    " order by fence desc limit 1", name) == [("released",)]
    assert sql(dsn, "select count(*) from pg_locks l join pg_stat_activity a using (pid)"
                    " where l.locktype = 'advisory' and a.application_name = %s", app) == [(0,)]
