"""How many NOTIFYs each pgcoord operation sends, and what the search_path pin costs.

    python bench/notify_count.py [--repeat 200]

Before PostgreSQL 19 every NOTIFY signals every listening session of the database
and its commit takes a database-wide lock, whoever hears it. A spy session LISTENs
to every pgcoord channel *without* registering as a listener, so it hears exactly
what the server sends and makes pgcoord send nothing more. Each operation is
counted twice: with nobody listening (a fleet of members that run electors, locks
and schedulers listens to nothing), and with one registered listener of each
channel (a ``watch()``, Partitions). On a schema without the register (before
migration 0010) the listener is a plain LISTEN.

The second table times the hot functions (member heartbeat, lease renew) in
``--repeat`` calls each in a server-side loop, as the schema ships them (a pinned
``search_path``, or a body bound when created) and with no function pinned (as
before 0010; the pins are removed, measured, and put back, in the same run),
interleaved in 9 rounds; the best round of each is kept (the machine is shared:
the best is the least disturbed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHANNELS = ("pgcoord_leases", "pgcoord_members", "pgcoord_schedules", "pgcoord_semaphores",
            "pgcoord_partitions")
PIN = "pg_catalog, pgcoord, pg_temp"


class Spy:
    def __init__(self, dsn: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        for channel in CHANNELS:
            self.conn.execute(f'LISTEN "{channel}"')

    def take(self, quiet: float = 0.25) -> int:
        n = 0
        while True:
            got = list(self.conn.notifies(timeout=quiet, stop_after=1))
            if not got:
                return n
            n += len(got)


class Listeners:
    """One registered listener of each channel (or a plain LISTEN before 0010)."""

    def __init__(self, dsn: str) -> None:
        import psycopg

        self.conn = psycopg.connect(dsn, autocommit=True)
        registers = self.conn.execute("select to_regproc('pgcoord.ears_open') is not null").fetchone()
        for channel in CHANNELS:
            if registers and registers[0]:
                self.conn.execute("select pgcoord.ears_open(%s)", (channel,))
            self.conn.execute(f'LISTEN "{channel}"')

    def close(self) -> None:
        self.conn.close()


async def operations(dsn: str) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    """(label, step) in order; each step is one operation, counted on its own."""
    import asyncpg

    import pgcoord

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    tag = uuid.uuid4().hex[:6]
    state: dict[str, Any] = {}

    async def sql(statement: str, *args: Any) -> Any:
        return await pool.fetchval(statement, *args)

    async def lease_acquire() -> None:
        state["fence"] = await sql("select fence from pgcoord.lease_acquire($1, 'a', 10000, null)", f"l-{tag}")

    async def lease_renew() -> None:
        await sql("select pgcoord.lease_renew($1, 'a', $2, 10000)", f"l-{tag}", state["fence"])

    async def lease_release() -> None:
        await sql("select pgcoord.lease_release($1, 'a', $2)", f"l-{tag}", state["fence"])

    async def lease_takeover() -> None:
        state["fence"] = await sql("select fence from pgcoord.lease_acquire($1, 'b', 10000, null)", f"l-{tag}")

    async def lease_resign() -> None:
        await sql("select pgcoord.request_resign($1)", f"l-{tag}")

    async def elector_term() -> None:
        led = asyncio.Event()

        async def lead(fence: int) -> None:
            led.set()
            await asyncio.sleep(3600)

        elector = pgcoord.Elector(dsn, f"e-{tag}", ttl=1.5)
        run = asyncio.create_task(elector.run(lead))
        await asyncio.wait_for(led.wait(), 10)
        await asyncio.sleep(1.0)  # two renewals
        await elector.stop()
        await asyncio.gather(run, return_exceptions=True)

    members: list[pgcoord.Member] = []

    async def member_join() -> None:
        m = pgcoord.Member(dsn, group=f"g-{tag}", ttl=1.5)
        await m.open()
        members.append(m)

    async def member_heartbeats() -> None:
        await asyncio.sleep(1.0)  # each member heartbeats every ttl/3

    async def member_leave() -> None:
        await members.pop().close()

    async def member_crash() -> None:
        victim = members.pop()
        await sql("select pg_terminate_backend($1)", victim._main.backend_pid)  # type: ignore[union-attr]
        await asyncio.sleep(0.5)
        await victim.close()

    async def semaphore_take_release() -> None:
        async with pgcoord.semaphore(pool, f"s-{tag}", limit=2):
            pass

    sched = pgcoord.Scheduler(pool, runner="count")

    @sched.cron(f"j-{tag}", "0 0 1 1 *")
    async def job(slot: object) -> None:
        pass

    async def schedule_add() -> None:
        await sched.add(f"k-{tag}", "0 0 1 1 *", handler=f"h-{tag}")

    async def schedule_pause() -> None:
        await sched.pause(f"k-{tag}")

    async def slot_claim_finish() -> None:
        await sched.trigger(f"j-{tag}")

    async def close() -> None:
        for m in members:
            await m.close()
        await pool.close()

    state["close"] = close
    steps = [
        ("lease acquire", lease_acquire),
        ("lease renew", lease_renew),
        ("lease release", lease_release),
        ("lease takeover (acquire of a released row)", lease_takeover),
        ("request_resign", lease_resign),
        ("Elector(dsn) term: acquire, 2 renewals, release", elector_term),
        ("member join (2 others present)", member_join),
        ("member heartbeats, 3 members, 1 s", member_heartbeats),
        ("member leave", member_leave),
        ("member session killed: reaped by a watcher, joins again, leaves", member_crash),
        ("semaphore take + release (pgcoord's transaction)", semaphore_take_release),
        ("schedule add", schedule_add),
        ("schedule pause", schedule_pause),
        ("slot claim + finish (trigger)", slot_claim_finish),
    ]
    # Two members present before the counted join.
    await member_join()
    await member_join()
    await asyncio.sleep(1.0)
    return steps + [("", close)]


async def count(dsn: str, listening: bool) -> dict[str, int]:
    spy = Spy(dsn)
    listeners = Listeners(dsn) if listening else None
    steps = await operations(dsn)
    spy.take()
    counts: dict[str, int] = {}
    try:
        for label, step in steps:
            await step()
            if label:
                counts[label] = spy.take()
    finally:
        if listeners is not None:
            listeners.close()
        spy.conn.close()
    return counts


def time_hot(dsn: str, repeat: int) -> list[tuple[str, float, float]]:
    """Mean µs per call of the hot functions, pinned and unpinned, interleaved."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select * from pgcoord.lease_acquire('hot', 'h', 600000, null)")
        fence = conn.execute("select fence from pgcoord.leases where name = 'hot'").fetchone()[0]  # type: ignore[index]
        member_id = conn.execute(
            "select id from pgcoord.member_join('hot', 'hot-' || pg_backend_pid(), '{}', 600000,"
            " 'bench', true)").fetchone()[0]  # type: ignore[index]
        calls = {
            "member_heartbeat": (f"perform pgcoord.member_heartbeat({member_id})",
                                 ["pgcoord.member_heartbeat(integer)", "pgcoord.member_reap_group(text)",
                                  "pgcoord.member_mark_gone(integer, text)",
                                  "pgcoord.member_sessions_alive()", "pgcoord.member_alive_ns()",
                                  "pgcoord.member_left_reason(timestamptz, integer)"]),
            "lease_renew": (f"perform pgcoord.lease_renew('hot', 'h', {fence}, 600000)",
                            ["pgcoord.lease_renew(text, text, bigint, bigint)", "pgcoord.lease_news()",
                             "pgcoord.lease_told()",
                             "pgcoord.leases_note_server()"]),
        }
        results: dict[tuple[str, bool], list[float]] = {}

        shipped = {fn: bool(conn.execute(
            "select coalesce(%s = any(proconfig), false) from pg_proc where oid = to_regprocedure(%s)",
            (f"search_path={PIN}", fn)).fetchone()[0])  # type: ignore[index]
            for fns in (c[1] for c in calls.values()) for fn in fns
            if conn.execute("select to_regprocedure(%s)", (fn,)).fetchone() != (None,)}

        def pin(functions: list[str], on: bool) -> None:
            """on: as the schema ships them; off: no function pinned (as before 0010)."""
            for fn in functions:
                if fn not in shipped:
                    continue
                clause = f"SET search_path = {PIN}" if on and shipped[fn] else "RESET search_path"
                conn.execute(f"ALTER FUNCTION {fn} {clause}")  # type: ignore[arg-type]

        try:
            for _ in range(9):
                for on in (True, False):
                    for name, (statement, functions) in calls.items():
                        pin(functions, on)
                        # In the server, in a loop: the client's round trip would hide it.
                        loop = f"do $$ begin for i in 1..{repeat} loop {statement}; end loop; end $$"
                        conn.execute(loop.replace(str(repeat), "20", 1))  # type: ignore[arg-type]
                        started = time.perf_counter()
                        conn.execute(loop)  # type: ignore[arg-type]
                        results.setdefault((name, on), []).append(
                            (time.perf_counter() - started) / repeat * 1e6)
        finally:
            for _name, (_s, functions) in calls.items():
                pin(functions, True)
            conn.execute("select pgcoord.member_leave(%s)", (member_id,))
        return [(name, min(results[(name, True)]), min(results[(name, False)]))
                for name in calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    from bench._server import bench_database

    with bench_database() as (dsn, _server):
        quiet = asyncio.run(count(dsn, listening=False))
        heard = asyncio.run(count(dsn, listening=True))
        print("| operation | NOTIFYs, nobody listens | NOTIFYs, one registered listener per channel |")
        print("|---|---:|---:|")
        for label in quiet:
            print(f"| {label} | {quiet[label]} | {heard[label]} |")
        print()
        print("| hot function (µs a call, in a server-side loop; best of 9 rounds) | as shipped | no pin | ratio |")
        print("|---|---:|---:|---:|")
        for name, pinned, unpinned in time_hot(dsn, args.repeat):
            print(f"| {name} | {pinned:.0f} | {unpinned:.0f} | {pinned / unpinned:.2f} |")


if __name__ == "__main__":
    main()
