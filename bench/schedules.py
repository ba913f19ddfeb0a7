"""Schedules at runtime at scale: 10,000 schedules (1,000 tenants x 10) on 4 replicas.

    python bench/schedules.py [--tenants 1000] [--per-tenant 10] [--replicas 4]
                              [--seconds 40] [--pattern spread|burst]

The schedules are rows of pgcoord.schedules naming one handler (added in one
INSERT, as a bulk add would be). "spread": each fires once a minute, at second
(i * 7) % 60, so about 167 slots come due each second. "burst": every schedule
fires at seconds 0, 20 and 40 of each minute, 10,000 slots at once. Each replica
process registers the handler and runs a Scheduler; it counts the statements it
sends by query name (wrapping the run_statement of the scheduler's modules: the
server's own counters, pg_stat_database, are flushed too lazily to time a
window). The start delay is started_at - slot_at, both
on the database clock, for slots due in the measured window.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def replica(dsn: str, handler: str, out: str) -> None:
    import asyncpg

    import pgcoord._finisher as finisher_module
    import pgcoord.scheduler as scheduler_module
    from pgcoord._queries import _all
    from pgcoord.scheduler import Scheduler, Slot

    names = {sql: name for name, sql in _all().items()}
    counts: collections.Counter[str] = collections.Counter()
    real = scheduler_module.run_statement

    async def counted(source: object, sql: str, params: tuple[object, ...]) -> object:
        counts[names.get(sql, "other")] += 1
        return await real(source, sql, params)

    scheduler_module.run_statement = counted  # type: ignore[assignment]
    finisher_module.run_statement = counted  # type: ignore[assignment]
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    sched = Scheduler(pool)

    @sched.job(handler)
    async def work(slot: Slot) -> None:
        pass

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, counts.clear)  # the measured window starts
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(sched.stop()))
    started = time.monotonic()
    await sched.run()
    _dump(out, {"counts": counts, "seconds": time.monotonic() - started})
    await pool.close()


def _dump(path: str, data: object) -> None:
    Path(path).write_text(json.dumps(data))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def run_scale(dsn: str, *, tenants: int = 1000, per_tenant: int = 10, replicas: int = 4,
              seconds: float = 40, warmup: float = 8, pattern: str = "spread") -> None:
    """Add the schedules, run the replicas, print the figures (markdown)."""
    import psycopg

    n = tenants * per_tenant
    handler = f"bench-tenant-{uuid.uuid4().hex[:6]}"
    expr = ("(i * 7 %% 60)::text || ' * * * * *'" if pattern == "spread"
            else "'*/20 * * * * *'")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"insert into pgcoord.schedules (name, handler, expr, args)"
            f" select %s || ':tenant-' || (i / %s) || ':' || (i %% %s), %s, {expr},"
            f" jsonb_build_object('tenant', i / %s)"
            f" from generate_series(0, %s - 1) as i",
            (handler, per_tenant, per_tenant, handler, per_tenant, n))
    outs = [f"/tmp/pgcoord-bench-schedules-{os.getpid()}-{i}.json" for i in range(replicas)]
    procs = [subprocess.Popen([sys.executable, __file__, "--replica", dsn, handler, out])
             for out in outs]
    time.sleep(warmup)

    def clock() -> float:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("select extract(epoch from clock_timestamp())").fetchone()
            assert row is not None
            return float(row[0])

    for p in procs:
        p.send_signal(signal.SIGUSR1)
    t0 = clock()
    time.sleep(seconds)
    t1 = clock()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(60)
    window = t1 - t0
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "select extract(epoch from started_at - slot_at) * 1000, state from pgcoord.job_slots"
            " where job like %s and not manual and slot_at > to_timestamp(%s)"
            " and slot_at <= to_timestamp(%s)", (handler + ":%", t0, t1)).fetchall()
        dupes = conn.execute("select count(*) - count(distinct (job, slot_at))"
                             " from pgcoord.job_slots where job like %s",
                             (handler + ":%",)).fetchone()
    delays = [float(d) for d, state in rows if state in ("succeeded", "running")]
    states = collections.Counter(state for _, state in rows)
    counts: collections.Counter[str] = collections.Counter()
    for out in outs:
        with open(out) as f:
            counts.update(json.load(f)["counts"])
        os.unlink(out)
    print(f"# Schedules at scale ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, loopback,"
          f" PostgreSQL and replicas on the same machine)\n")
    print(f"{n:,} schedules ({tenants:,} tenants x {per_tenant}), pattern"
          f" {pattern!r}, {replicas} replica processes, {window:.0f} s measured after"
          f" {warmup:g} s warm-up: {len(rows):,} slots due, states {dict(states)},"
          f" duplicate slots {dupes[0] if dupes else '?'}\n")
    print("| slot due to start | p50 | p99 | max |")
    print("|---|---:|---:|---:|")
    print(f"| delay | {pct(delays, .5):,.0f} ms | {pct(delays, .99):,.0f} ms | "
          f"{max(delays, default=float('nan')):,.0f} ms |\n")
    total = sum(counts.values())
    print(f"Database load: {total / window:,.1f} statements/s from all replicas"
          f" ({len(rows) / window:,.0f} slots/s due), each in a transaction of its own;"
          f" by query:\n")
    print("| query | per second | per slot due |")
    print("|---|---:|---:|")
    for name, count in counts.most_common():
        print(f"| {name} | {count / window:,.1f} | {count / max(1, len(rows)):.2f} |")




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--per-tenant", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--warmup", type=float, default=8)
    parser.add_argument("--pattern", choices=("spread", "burst"), default="spread")
    parser.add_argument("--replica", nargs=3, metavar=("DSN", "HANDLER", "OUT"))
    args = parser.parse_args()
    if args.replica:
        asyncio.run(replica(*args.replica))
        return
    from bench._server import bench_database

    with bench_database() as (dsn, _):
        run_scale(dsn, tenants=args.tenants, per_tenant=args.per_tenant, replicas=args.replicas,
                  seconds=args.seconds, warmup=args.warmup, pattern=args.pattern)


if __name__ == "__main__":
    main()
