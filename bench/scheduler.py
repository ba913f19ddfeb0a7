"""Scheduler latency: from a slot coming due to its start, many replicas and jobs.

    python bench/scheduler.py [--replicas 10] [--jobs 100] [--seconds 15] [--scale-seconds 30]

Starts REPLICAS processes, each registering the same JOBS per-second jobs
("* * * * * *"), lets them run, then reads pgcoord.job_slots: the start delay
is started_at - slot_at, both on the database clock. Also checks that no slot
ran twice and every slot has a row. Then, on the same server, schedules at
run time at scale (bench/schedules.py): 10,000 schedules on 4 replicas, spread
over the minute and in bursts of 10,000 (0 to skip with --scale-seconds 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def replica(dsn: str, prefix: str, jobs: int) -> None:
    import asyncpg

    from pgcoord.scheduler import Scheduler, Slot

    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    sched = Scheduler(pool)

    async def work(slot: Slot) -> None:
        pass

    for i in range(jobs):
        sched.cron(f"{prefix}:{i:03d}", "* * * * * *")(work)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: asyncio.ensure_future(sched.stop()))
    await sched.run()
    await pool.close()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--scale-seconds", type=float, default=30)
    parser.add_argument("--replica", nargs=3, metavar=("DSN", "PREFIX", "JOBS"))
    args = parser.parse_args()
    if args.replica:
        asyncio.run(replica(args.replica[0], args.replica[1], int(args.replica[2])))
        return

    import psycopg

    from bench._server import bench_database

    with bench_database() as (dsn, _):
        prefix = f"bench-sched-{uuid.uuid4().hex[:6]}"
        procs = [subprocess.Popen([sys.executable, __file__, "--replica", dsn, prefix,
                                   str(args.jobs)]) for _ in range(args.replicas)]
        warmup = 3.0
        time.sleep(warmup + args.seconds)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "select extract(epoch from started_at - slot_at), state from pgcoord.job_slots"
                " where job like %s and slot_at > (select min(registered_at) from pgcoord.jobs"
                " where job like %s) + %s * interval '1 second'",
                (prefix + ":%", prefix + ":%", warmup)).fetchall()
        delays = [float(d) * 1000 for d, state in rows if state in ("succeeded", "running")]
        others = {}
        for _, state in rows:
            others[state] = others.get(state, 0) + 1
        print(f"# Scheduler benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
              f"loopback)\n")
        print(f"{args.replicas} replica processes x {args.jobs} per-second jobs, "
              f"{args.seconds:g} s measured after {warmup:g} s warm-up: {len(rows)} slots, "
              f"states {others}\n")
        print("| slot due to start | p50 | p99 | max |")
        print("|---|---:|---:|---:|")
        print(f"| delay | {pct(delays, .5):,.0f} ms | {pct(delays, .99):,.0f} ms | "
              f"{max(delays):,.0f} ms |\n")
        if args.scale_seconds > 0:
            from bench.schedules import run_scale

            for pattern in ("spread", "burst"):
                run_scale(dsn, seconds=args.scale_seconds, warmup=8, pattern=pattern)
                print()


if __name__ == "__main__":
    main()
