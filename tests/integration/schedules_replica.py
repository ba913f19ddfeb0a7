"""One replica for the schedules tests (docs/schedules.md), run as its own process.

    python schedules_replica.py DSN LABEL HANDLERS [member] [churn NAME]

HANDLERS is a comma-separated list of handler names registered with
@sched.job; each run is recorded in table sched_runs (job, slot_at, manual,
args, runner) as it starts, and sleeps args["sleep"] seconds if given. With
``member`` the scheduler listens for changes on a Member's session. With
``churn NAME`` the process also changes schedule NAME over and over (expr, args,
pause/resume), printing ``CHANGE n`` before each change, so that a test can kill
it in the middle of one. SIGTERM stops the scheduler gracefully.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys

import asyncpg

import pgcoord
from pgcoord.scheduler import Scheduler, Slot


async def churn(sched: Scheduler, name: str) -> None:
    n = 0
    while True:
        n += 1
        print(f"CHANGE {n}", flush=True)
        if n % 3 == 0:
            await sched.pause(name)
            await sched.resume(name)
        else:
            await sched.update(name, expr="* * * * * *" if n % 2 else "*/2 * * * * *",
                               args={"n": n})
        await asyncio.sleep(0.01)


async def main(dsn: str, label: str, handlers: str, *extra: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    member = pgcoord.Member(dsn, group="sched-replicas", name=label) if "member" in extra else None
    if member is not None:
        await member.open()
    sched = Scheduler(pool, runner=None if member else label, member=member)

    def register(handler: str) -> None:
        @sched.job(handler, claim_ttl=1.0)
        async def work(slot: Slot) -> None:
            await pool.execute("insert into sched_runs (job, slot_at, manual, args, runner)"
                               " values ($1, $2, $3, $4, $5)", slot.job, slot.at, slot.manual,
                               json.dumps(slot.args), label)
            await asyncio.sleep(float((slot.args or {}).get("sleep", 0)))

    for handler in handlers.split(","):
        register(handler)
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: asyncio.ensure_future(sched.stop()))
    task = asyncio.create_task(sched.run())
    changer = asyncio.create_task(churn(sched, extra[extra.index("churn") + 1])) \
        if "churn" in extra else None
    print("READY", flush=True)
    try:
        await task
    finally:
        if changer is not None:
            changer.cancel()
        if member is not None:
            await member.close()
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
