"""Schedules at runtime at scale: 10,000 schedules (1,000 tenants x 10) on 4 replicas.

    python bench/schedules.py [--tenants 1000] [--per-tenant 10] [--replicas 4]
                              [--seconds 40] [--pattern spread|burst] [--changes 5]
    python bench/schedules.py --pieces      # each piece of the loop at this scale, alone

The schedules are rows of pgcoord.schedules naming one handler (added in one
INSERT, as a bulk add would be). "spread": each fires once a minute, at second
(i * 7) % 60, so about 167 slots come due each second. "burst": every schedule
fires at seconds 0, 20 and 40 of each minute, 10,000 slots at once. Each replica
process registers the handler and runs a Scheduler; it counts the statements it
sends by query name (wrapping the run_statement of the scheduler's modules: the
server's own counters, pg_stat_database, are flushed too lazily to time a
window). The start delay is started_at - slot_at, both
on the database clock, for slots due in the measured window.

With --changes R (> 0) a second window as long as the first follows, in the same
run, in which R schedules a second are changed (their args, through
pgcoord.schedule_update, each its own statement): every change makes every
replica reload its schedules, so the figures of both windows are printed side by
side, the first as the baseline.
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def replica(dsn: str, handler: str, out: str) -> None:
    import asyncpg

    import pgcoord.scheduler.finisher as finisher_module
    import pgcoord.scheduler.store as store_module
    from pgcoord._core.queries import _all
    from pgcoord.scheduler import Scheduler, Slot

    names = {sql: name for name, sql in _all().items()}
    counts: collections.Counter[str] = collections.Counter()
    real = store_module.run_statement

    async def counted(source: object, sql: str, params: tuple[object, ...]) -> object:
        counts[names.get(sql, "other")] += 1
        return await real(source, sql, params)

    store_module.run_statement = counted  # type: ignore[assignment]
    finisher_module.run_statement = counted  # type: ignore[assignment]
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    sched = Scheduler(pool)

    @sched.job(handler)
    async def work(slot: Slot) -> None:
        pass

    loop = asyncio.get_running_loop()
    baseline: dict[str, int] = {}

    def second_window() -> None:
        baseline.update(counts)
        counts.clear()

    loop.add_signal_handler(signal.SIGUSR1, counts.clear)  # the measured window starts
    loop.add_signal_handler(signal.SIGUSR2, second_window)  # the window with changes starts
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(sched.stop()))
    started = time.monotonic()
    await sched.run()
    _dump(out, {"counts": counts, "baseline": baseline, "seconds": time.monotonic() - started})
    await pool.close()


def _dump(path: str, data: object) -> None:
    Path(path).write_text(json.dumps(data))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _change(dsn: str, handler: str, n: int, per_tenant: int, rate: float, until: float) -> int:
    """Change the args of one schedule after another, ``rate`` a second, until ``until``
    (monotonic); the number of changes made."""
    import random

    import psycopg

    made = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.monotonic()
        while time.monotonic() < until:
            i = random.randrange(n)
            conn.execute("select pgcoord.schedule_update(%s, %s)",
                         (f"{handler}:tenant-{i // per_tenant}:{i % per_tenant}",
                          json.dumps({"args": {"tenant": i // per_tenant, "change": made}})))
            made += 1
            time.sleep(max(0.0, start + made / rate - time.monotonic()))
    return made


def _window(dsn: str, handler: str, t0: float, t1: float) -> tuple[list[float], Any, Any]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "select extract(epoch from started_at - slot_at) * 1000, state from pgcoord.job_slots"
            " where job like %s and not manual and slot_at > to_timestamp(%s)"
            " and slot_at <= to_timestamp(%s)", (handler + ":%", t0, t1)).fetchall()
    delays = [float(d) for d, state in rows if state in ("succeeded", "running")]
    return delays, rows, collections.Counter(state for _, state in rows)


def run_scale(dsn: str, *, tenants: int = 1000, per_tenant: int = 10, replicas: int = 4,
              seconds: float = 40, warmup: float = 8, pattern: str = "spread",
              changes: float = 0.0) -> None:
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
    made = 0
    if changes > 0:
        for p in procs:
            p.send_signal(signal.SIGUSR2)
        t1 = clock()
        made = _change(dsn, handler, n, per_tenant, changes, time.monotonic() + seconds)
        t2 = clock()
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
    changed: collections.Counter[str] = collections.Counter()
    for out in outs:
        with open(out) as f:
            data = json.load(f)
        if changes > 0:
            counts.update(data["baseline"])
            changed.update(data["counts"])
        else:
            counts.update(data["counts"])
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
    if changes > 0:
        late, late_rows, late_states = _window(dsn, handler, t1, t2)
        window2 = t2 - t1
        print(f"\nWith changes: {made:,} schedules changed in {window2:.0f} s"
              f" ({made / window2:,.1f}/s, one statement each), right after the window above;"
              f" {len(late_rows):,} slots due, states {dict(late_states)}\n")
        print("| | baseline (no changes) | with changes | ratio |")
        print("|---|---:|---:|---:|")
        for label, q in (("delay p50", .5), ("delay p99", .99)):
            a, b = pct(delays, q), pct(late, q)
            print(f"| {label} | {a:,.0f} ms | {b:,.0f} ms | {b / a if a else float('nan'):.2f}x |")
        a, b = sum(counts.values()) / window, sum(changed.values()) / window2
        print(f"| statements/s, all replicas | {a:,.1f} | {b:,.1f} | {b / a:.2f}x |")
        for name in sorted(set(counts) | set(changed)):
            a, b = counts[name] / window, changed[name] / window2
            print(f"| {name}/s | {a:,.1f} | {b:,.1f} | {b / a if a else float('inf'):.2f}x |")



async def _piece_costs(dsn: str, handler: str, n: int, repeat: int,
                       ) -> list[tuple[str, str, float, float, float]]:
    """Each piece of a tick (and of the housekeeping between ticks) of one replica that
    runs ``n`` schedules, timed alone: (piece, how often, ms of the first pass, median ms
    a pass, worst ms the event loop went without a turn during the passes)."""
    import statistics

    import asyncpg

    from pgcoord.scheduler import Scheduler, Slot
    from pgcoord.scheduler import plan as plan_module

    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    sched = Scheduler(pool)

    @sched.job(handler)
    async def work(slot: Slot) -> None:
        pass

    worst_gap = [0.0]
    last_turn = [time.perf_counter()]

    async def watch() -> None:  # the longest the event loop went without a turn
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst_gap[0] = max(worst_gap[0], now - last_turn[0])
            last_turn[0] = now

    async def timed(fn: Any) -> tuple[float, float, float]:
        times = []
        await asyncio.sleep(0.01)  # the watcher's turn: a gap of the piece before is not this one's
        worst_gap[0], last_turn[0] = 0.0, time.perf_counter()
        for _ in range(repeat):
            began = time.perf_counter()
            took = await fn()  # a piece may time only its own part
            times.append(time.perf_counter() - began if took is None else took)
        return times[0] * 1000, statistics.median(times) * 1000, worst_gap[0] * 1000

    watcher = asyncio.create_task(watch())
    try:
        await sched._reload()
        specs = list(sched._specs.values())
        assert len(specs) == n, (len(specs), n)
        # The first tick decides what came due since the schedules' start (and no
        # housekeeping: each piece of it is timed below).
        sched._last_recover = sched._last_prune = sched._last_alert_check = time.monotonic()
        await sched.tick()

        async def full_reload() -> None:  # as at the start: nothing loaded yet
            sched._epoch, sched._specs = None, {}
            await sched._reload()

        async def one_change() -> None:  # a reload after one schedule's change
            async with pool.acquire() as conn:
                await conn.execute("select pgcoord.schedule_update($1, $2)", specs[0].name,
                                   json.dumps({"args": {"change": time.time()}}))
            await sched._reload()

        async def plan_only() -> None:
            now = (await sched._store.clock())[0]
            plan_module.due(sched._specs.values(), now)
            plan_module.next_wake(sched._specs.values(), now, 1.0)

        async def idle_tick() -> None:  # nothing due (all decided), no housekeeping due
            sched._last_recover = sched._last_prune = sched._last_alert_check = time.monotonic()
            await sched.tick()

        async def tick_prune_due() -> float:  # the tick alone, when the retention pass is due
            sched._last_recover = sched._last_alert_check = time.monotonic()
            sched._last_prune = 0.0
            sched._run_task = asyncio.current_task()  # as inside run()
            began = time.perf_counter()
            try:
                await sched.tick()
            finally:
                sched._run_task = None
            took = time.perf_counter() - began
            chores = getattr(sched, "_chores", None)  # beside the loop, since issue 22
            pending = chores.pending() if chores is not None else []
            if pending:
                await asyncio.wait(pending)
            return took

        async def recover() -> None:
            await sched._claims.recover(list(sched._specs.values()), sched.runner)

        async def prune() -> None:
            await sched._store.prune(list(sched._specs.values()))

        async def alerts() -> None:
            await sched.check_failing()

        pieces = [
            ("schedule_tick + plan (due, next wake)", "every tick", plan_only),
            ("tick with nothing due", "every tick", idle_tick),
            ("tick with the retention pass due", "5 min", tick_prune_due),
            ("reload, one schedule changed", "each change", one_change),
            ("full load, every schedule", "run()'s start", full_reload),
            ("recovery (schedule_recover)", "claim_ttl / 3", recover),
            ("retention (schedule_prune, whole pass)", "5 min", prune),
            ("failing-job alert (check_failing)", "1 min", alerts),
        ]
        found = []
        for label, often, fn in pieces:
            first, median, gap = await timed(fn)
            found.append((label, often, first, median, gap))
            print(f"  ({label}: {median:,.1f} ms)", file=sys.stderr, flush=True)
        return found
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await pool.close()


def run_pieces(dsn: str, *, tenants: int = 1000, per_tenant: int = 10, old_rows: int = 20,
               repeat: int = 5) -> None:
    """The per-tick cost of each piece of the loop with ``tenants * per_tenant`` schedules
    (each with ``old_rows`` finished rows past their keep, for retention to find)."""
    import psycopg

    n = tenants * per_tenant
    handler = f"bench-pieces-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "insert into pgcoord.schedules (name, handler, expr, args, since)"
            " select %s || ':tenant-' || (i / %s) || ':' || (i %% %s), %s,"
            " (i %% 60)::text || ' ' || (i / 60 %% 60)::text || ' * * * *', '{}',"
            " clock_timestamp() - interval '30 seconds' from generate_series(0, %s - 1) as i",
            (handler, per_tenant, per_tenant, handler, n))
        conn.execute(
            "insert into pgcoord.job_slots (job, slot_at, state, attempt, started_at, finished_at)"
            " select s.name, now() - interval '59 days' - k * interval '1 hour', 'succeeded', 1,"
            " now() - interval '59 days', now() - interval '59 days'"
            " from pgcoord.schedules as s cross join generate_series(1, %s) as k"
            " where s.handler = %s", (old_rows, handler))
        conn.execute("analyze pgcoord.job_slots")
    found = asyncio.run(_piece_costs(dsn, handler, n, repeat))
    print(f"# The loop's pieces at scale ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores,"
          f" loopback)\n")
    print(f"One replica running {n:,} schedules (3,600 distinct expressions), {old_rows} finished"
          f" rows each past their keep; each piece timed alone, median of {repeat} passes"
          f" (retention: the first pass deletes, the rest find nothing)\n")
    print("| piece | how often | first pass | median pass | longest the event loop went"
          " without a turn |")
    print("|---|---|---:|---:|---:|")
    for label, often, first, median, gap in found:
        print(f"| {label} | {often} | {first:,.1f} ms | {median:,.1f} ms | {gap:,.1f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--per-tenant", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument("--warmup", type=float, default=8)
    parser.add_argument("--pattern", choices=("spread", "burst"), default="spread")
    parser.add_argument("--changes", type=float, default=0.0,
                        help="schedules changed per second in a second window (0: none)")
    parser.add_argument("--pieces", action="store_true",
                        help="only time each piece of the loop alone, at this scale")
    parser.add_argument("--replica", nargs=3, metavar=("DSN", "HANDLER", "OUT"))
    args = parser.parse_args()
    if args.replica:
        asyncio.run(replica(*args.replica))
        return
    from bench._server import bench_database

    with bench_database() as (dsn, _):
        if args.pieces:
            run_pieces(dsn, tenants=args.tenants, per_tenant=args.per_tenant)
            return
        run_scale(dsn, tenants=args.tenants, per_tenant=args.per_tenant, replicas=args.replicas,
                  seconds=args.seconds, warmup=args.warmup, pattern=args.pattern,
                  changes=args.changes)


if __name__ == "__main__":
    main()
