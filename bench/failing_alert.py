"""The failing-job alert (``check_failing``) at 10,000 schedules that are all judged.

    python bench/failing_alert.py [--code PATH] [--passes 7]

10,000 hourly schedules (3,600 distinct expressions) counted from two days ago, each
with rows for its last 8 hourly slots: every 10th schedule's failed, the rest
succeeded, so 1,000 are failing. Prints the median and each pass in ms, and how many
were found. ``--code`` imports pgcoord from another checkout (a git worktree of an
older commit), to compare two versions back to back on the same host.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = """
insert into pgcoord.schedules (name, handler, expr, args, since)
select 'alert-bench:' || i, 'h', (i % 60)::text || ' ' || (i / 60 % 60)::text || ' * * * *',
       '{}', clock_timestamp() - interval '2 days'
from generate_series(0, 9999) as i
"""
SLOTS = """
insert into pgcoord.job_slots (job, slot_at, state, attempt, started_at, finished_at)
select t.name, t.at,
       case when split_part(t.name, ':', 2)::int % 10 = 0 then 'failed' else 'succeeded' end,
       1, t.at, t.at + interval '1 minute'  -- each run took a minute
from (select s.name,
             date_trunc('hour', now()) - k * interval '1 hour'
               + split_part(s.expr, ' ', 2)::int * interval '1 minute'
               + split_part(s.expr, ' ', 1)::int * interval '1 second' as at
      from pgcoord.schedules as s cross join generate_series(1, 8) as k) as t
"""


async def passes(dsn: str, n: int) -> tuple[int, list[float]]:
    import asyncpg

    from pgcoord.scheduler.alerts import FailingWatch

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        watch, times, found = FailingWatch(3), [], []
        for _ in range(n):
            began = time.perf_counter()
            found = await watch.check(pool)
            times.append((time.perf_counter() - began) * 1000)
        return len(found), times
    finally:
        await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=ROOT)
    parser.add_argument("--passes", type=int, default=7)
    args = parser.parse_args()
    # That checkout's pgcoord, its migrations and its server harness.
    sys.path.insert(0, os.path.abspath(args.code))
    import psycopg

    import pgcoord
    from bench._server import bench_database

    print(f"pgcoord from {os.path.dirname(pgcoord.__file__)}", file=sys.stderr)

    with bench_database() as (dsn, _):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SCHEDULES)
            conn.execute(SLOTS)
            conn.execute("analyze pgcoord.job_slots")
        found, times = asyncio.run(passes(dsn, args.passes))
    print(f"| {args.code} | {found:,} | {statistics.median(times):,.0f} ms |"
          f" {', '.join(f'{t:,.0f}' for t in times)} |")


if __name__ == "__main__":
    main()
