"""``pgcoord demo``: pgcoord working for real, on a throwaway server by default.

Steps: two tasks contend on ``exclusive()``; three replica processes elect a
leader; the leader is SIGKILLed and the takeover measured; the dead leader's
fence is refused by ``check_fence``; a per-second cron job runs once per slot
across the replicas; ``pgcoord status`` shows who holds what.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from .. import migrations
from .._core.embedded import EmbeddedServer
from .status import fetch_holders, format_table

LEADER = "demo:leader"
CRON_JOB = "demo:every-second"


def _step(n: int, text: str) -> None:
    print(f"[{n}/6] {text}", flush=True)


def _indent(text: str) -> str:
    return "      " + text.replace("\n", "\n      ")


@contextlib.contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    print("[0/6] starting a throwaway PostgreSQL (binaries found on this machine)", flush=True)
    with EmbeddedServer() as server:
        print(f"      {server.dsn}  (PostgreSQL {server.bindir.parent.name}, data in a temp dir)")
        yield server.dsn


async def _contend(dsn: str) -> None:
    import psycopg_pool

    import pgcoord

    async with psycopg_pool.AsyncConnectionPool(
        dsn, min_size=2, max_size=3, open=False, kwargs={"application_name": "pgcoord-demo"},
    ) as pool:
        first_holds = asyncio.Event()

        async def worker(name: str, hold: float) -> None:
            started = time.monotonic()
            async with pgcoord.exclusive(pool, "demo:nightly-invoices") as conn:
                waited = time.monotonic() - started
                print(f"      {name} holds the lock (waited {waited * 1000:.0f} ms), "
                      f"pid {conn.info.backend_pid}", flush=True)
                first_holds.set()
                await asyncio.sleep(hold)

        first = asyncio.create_task(worker("task A", 1.0))
        await first_holds.wait()
        second = asyncio.create_task(worker("task B", 0.0))
        await asyncio.sleep(0.3)
        print("      pgcoord.holders while A holds and B waits:")
        print(_indent(format_table(await asyncio.to_thread(fetch_holders, dsn), 74)))
        await asyncio.gather(first, second)


# -- the replicas --------------------------------------------------------------------------

async def _replica(dsn: str, label: str) -> None:
    """One demo replica process: an elector and a scheduler."""
    import asyncpg

    import pgcoord

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3,
                                     server_settings={"application_name": f"demo-{label}"})
    elector = pgcoord.Elector(dsn, LEADER, ttl=2.0, holder=label)
    sched = pgcoord.Scheduler(pool, runner=label)

    @sched.cron(CRON_JOB, "* * * * * *")
    async def every_second(slot: pgcoord.Slot) -> None:
        await pool.execute("insert into demo_cron_runs (slot_at, replica) values ($1, $2)",
                           slot.at, label)

    async def lead(fence: int) -> None:
        while True:
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, LEADER, fence)
                await conn.execute("insert into demo_fenced_writes (fence, replica)"
                                   " values ($1, $2)", fence, label)
            await asyncio.sleep(0.2)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(elector.run(lead)), asyncio.create_task(sched.run())]
    await stop.wait()
    await elector.stop()
    await sched.stop(drain=2)
    await asyncio.gather(*tasks, return_exceptions=True)
    await pool.close()


def _sql(dsn: str, statement: str, *params: object) -> list[tuple[object, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)
        return cur.fetchall() if cur.description else []


def _wait_for(dsn: str, statement: str, params: tuple[object, ...], timeout: float
              ) -> list[tuple[object, ...]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rows := _sql(dsn, statement, *params):
            return rows
        time.sleep(0.01)
    raise RuntimeError(f"demo: nothing happened within {timeout}s")


def _replicas_demo(dsn: str) -> None:
    _sql(dsn, "create table if not exists demo_cron_runs (slot_at timestamptz, replica text)")
    _sql(dsn, "create table if not exists demo_fenced_writes (id serial, fence bigint,"
              " replica text)")
    _step(2, "three replica processes elect a leader (pgcoord.Elector, ttl 2 s)")
    procs = {
        label: subprocess.Popen([sys.executable, "-m", "pgcoord.cli.demo", "--replica", dsn, label],
                                stdin=subprocess.DEVNULL)
        for label in ("replica-1", "replica-2", "replica-3")
    }
    try:
        [(leader, fence)] = _wait_for(
            dsn, "select holder, fence from pgcoord.leases where name = %s and holder is not null",
            (LEADER,), 30)
        print(f"      {leader} leads with fence {fence}; the others wait on its doorbell lock")
        time.sleep(1.5)

        _step(3, f"SIGKILL the leader ({leader}, pid {procs[str(leader)].pid})")
        [(killed_at,)] = _sql(dsn, "select clock_timestamp()")
        procs[str(leader)].kill()
        [(new_leader, new_fence, took)] = _wait_for(
            dsn, "select holder, fence, extract(epoch from acquired_at - %s) * 1000"
                 " from pgcoord.leases where name = %s and fence > %s",
            (killed_at, LEADER, fence), 30)
        print(f"      {new_leader} took over with fence {new_fence}, "
              f"{float(str(took)):.0f} ms after the kill (a lease-polling elector waits out the ttl)")

        _step(4, f"the dead leader's fence {fence} is refused by check_fence")
        import psycopg

        import pgcoord

        with psycopg.connect(dsn) as conn:
            try:
                pgcoord.check_fence(conn, LEADER, int(fence))  # type: ignore[call-overload]
                conn.execute("insert into demo_fenced_writes (fence, replica) values (%s, 'stale')",
                             (fence,))
                print("      !! the stale write went through")
            except pgcoord.StaleFence as stale:
                print(f"      rejected: {stale}")
        [(writes_after,)] = _sql(dsn, "select count(*) from demo_fenced_writes where fence = %s"
                                      " and id > (select min(id) from demo_fenced_writes"
                                      " where fence = %s)", fence, new_fence)
        print(f"      writes with the old fence after the new leader's first write: {writes_after}")

        _step(5, f"a per-second cron job ({CRON_JOB}) across the replicas")
        time.sleep(3.2)
        rows = _sql(dsn, "select count(*), count(distinct slot_at),"
                         " string_agg(distinct replica, ', ') from demo_cron_runs")
        runs, slots, who = rows[0]
        print(f"      {runs} runs for {slots} slots (each slot once), run by {who}")
        [(states,)] = _sql(dsn, "select string_agg(state || ' ' || n, ', ') from (select state,"
                                " count(*) n from pgcoord.job_slots where job = %s"
                                " group by state) s", CRON_JOB)
        print(f"      pgcoord.job_slots: {states}")

        _step(6, "pgcoord status")
        print(_indent(format_table(fetch_holders(dsn), 74)))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_demo(dsn: str | None) -> int:
    started = time.monotonic()
    with _database(dsn) as url:
        migrations.upgrade(url)
        print(f"      schema installed (pgcoord migrate), revision {migrations.current(url)}")
        _step(1, "two tasks contend for exclusive(pool, 'demo:nightly-invoices')")
        asyncio.run(_contend(url))
        _replicas_demo(url)
        if dsn is None:
            print("[done] stopping the replicas and removing the throwaway server")
    print(f"demo finished in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--replica":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_replica(sys.argv[2], sys.argv[3]))
        sys.exit(0)
    sys.exit(run_demo(os.environ.get("PGCOORD_DSN")))
