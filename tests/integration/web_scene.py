"""A fleet for the dashboard's browser tests and screenshots: members in two groups
with partitions, electors (one on a member), held and awaited session locks, a
semaphore, a vacant election, and schedules with a history. It runs on an event
loop of its own in a thread, so that the (synchronous) browser can look at it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import asyncpg

import pgcoord

from .conftest import sql

SCHEDULES = (
    ("nightly-invoices", "0 2 * * *", "Europe/Berlin", "send-invoices"),
    ("digest:team-42", "0 9 * * 1", "Europe/Paris", "send-digest"),
    ("refresh-rates", "*/5 * * * *", "UTC", "refresh-rates"),
    ("vacuum-archive", "30 3 * * 0", "UTC", "vacuum"),
    ("sync-crm", "*/15 * * * *", "America/New_York", "sync-crm"),
)


async def _never(*_: Any) -> None:
    await asyncio.Event().wait()


async def _scene(dsn: str, ready: threading.Event, stop: asyncio.Event) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    sched = pgcoord.Scheduler(pool)
    for name, expr, tz, handler in SCHEDULES:
        await sched.add(name, expr, handler=handler, tz=tz, args={"source": "web"})
    await sched.pause("vacuum-archive")
    # A history: the digest succeeds, refresh-rates fails twice in a row lately.
    for job, state in (("digest:team-42", "succeeded"), ("refresh-rates", "succeeded"),
                       ("nightly-invoices", "succeeded"), ("sync-crm", "succeeded")):
        sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner, started_at, finished_at)"
                 " select %s, date_trunc('minute', now()) - make_interval(hours => g), %s, 1, 'billing-a/1',"
                 " date_trunc('minute', now()) - make_interval(hours => g),"
                 " date_trunc('minute', now()) - make_interval(hours => g) + interval '2.5s'"
                 " from generate_series(3, 90) as g on conflict do nothing", job, state)
    sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, reason, attempt, runner, started_at,"
             " finished_at, error) select 'refresh-rates', date_trunc('minute', now()) - make_interval(mins => g * 5),"
             " 'failed', 'error', 1, 'billing-b/2', now() - make_interval(mins => g * 5),"
             " now() - make_interval(mins => g * 5) + interval '1s',"
             " 'ConnectionError: rates.example.com timed out after 10 s' from generate_series(1, 2) as g"
             " on conflict do nothing")
    lease = pgcoord.Lease(pool, "nightly-export", ttl=5.0, holder="export-7f3a")
    await lease.acquire()
    await lease.release()
    # Some history for reports-leader: a term released, then one left to expire
    # (the elector below takes over from it).
    earlier = pgcoord.Lease(pool, "reports-leader", ttl=5.0, holder="reports-0")
    await earlier.acquire()
    await earlier.release()
    await pool.execute("select pgcoord.lease_acquire('reports-leader', 'reports-2', 200, null)")
    await asyncio.sleep(0.3)
    async with contextlib.AsyncExitStack() as stack:
        m1 = await stack.enter_async_context(pgcoord.Member(
            dsn, group="billing", name="billing-a", meta={"zone": "eu-west-1a", "version": "2.4.1"},
            application_name="billing-worker"))
        m2 = await stack.enter_async_context(pgcoord.Member(
            dsn, group="billing", name="billing-b", meta={"zone": "eu-west-1b", "version": "2.4.1"},
            application_name="billing-worker"))
        m3 = await stack.enter_async_context(pgcoord.Member(
            dsn, group="ingest", name="ingest-1", meta={"zone": "us-east-1a"},
            application_name="ingest"))
        tasks = [asyncio.create_task(pgcoord.Partitions(m, "invoices", count=8).run(_never))
                 for m in (m1, m2)]
        tasks.append(asyncio.create_task(pgcoord.Elector(m1, "billing-scheduler", ttl=10.0).run(_never)))
        reports = pgcoord.Elector(dsn, "reports-leader", ttl=10.0, holder="reports-1",
                                  application_name="reports")
        tasks.append(asyncio.create_task(reports.run(_never)))
        holder = await stack.enter_async_context(pgcoord.LockHolder(m3))
        await stack.enter_async_context(holder.semaphore("partner-api", limit=3))
        await stack.enter_async_context(holder.lock("rebuild-search-index"))
        # Transaction-scope locks record their names for every session to read.
        holding = await asyncpg.create_pool(dsn, min_size=1, max_size=2,
                                            server_settings={"application_name": "reindex"})
        stack.push_async_callback(holding.close)
        await stack.enter_async_context(pgcoord.exclusive(holding, "reindex-orders"))
        waiting = await asyncpg.create_pool(dsn, min_size=1, max_size=1,
                                            server_settings={"application_name": "reindex-cron"})
        stack.push_async_callback(waiting.close)
        tasks.append(asyncio.create_task(pgcoord.exclusive(waiting, "reindex-orders").__aenter__()))
        try:
            async with asyncio.timeout(20):
                while not reports.is_leader or len(await _parts(pool)) < 8:
                    await asyncio.sleep(0.05)
            ready.set()
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()


async def _parts(pool: asyncpg.Pool) -> list[Any]:
    return list(await pool.fetch("select name from pgcoord.leases where name like 'invoices/%%'"
                                 " and holder is not null and expires_at > now()"))


@contextlib.contextmanager
def scene(dsn: str) -> Iterator[None]:
    """Run the fleet until the block ends."""
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failed: list[BaseException] = []

    def main() -> None:
        try:
            loop.run_until_complete(_scene(dsn, ready, stop))
        except BaseException as exc:
            failed.append(exc)
            ready.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, daemon=True, name="web scene")
    thread.start()
    ready.wait(30)
    if failed:
        raise failed[0]
    assert ready.is_set(), "the scene did not come up"
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
