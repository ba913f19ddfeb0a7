"""One replica for the scheduler fault tests, run as its own process.

    python scheduler_replica.py DSN JOB MODE LABEL [member CLAIM_TTL | readme]

MODE is "skip", "retry" or "transactional". A per-second job records each
start in job_starts (autocommit, before the work) and then works for 0.4 s;
transactional mode writes its effect into job_effects inside the slot's
transaction. With ``member``, the scheduler's claims are tied to a Member (its
runner is then the member's name and id). With ``readme``, the scheduler is the
README's form as written: ``Scheduler(pool)``, the default claim_ttl. SIGTERM stops the scheduler gracefully.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import asyncpg

import pgcoord
from pgcoord.scheduler import Scheduler, Slot


async def main(dsn: str, job: str, mode: str, label: str, *extra: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=4)
    member = pgcoord.Member(dsn, group=f"sched:{job}", name=label) if extra[:1] == ("member",) else None
    readme = extra[:1] == ("readme",)
    claim_ttl = float(extra[1]) if len(extra) > 1 else 30.0 if readme else 1.0
    if member is not None:
        await member.open()
        print(f"MEMBER {member.id}", flush=True)
    sched = (Scheduler(pool) if readme
             else Scheduler(pool, runner=None if member else label, member=member))

    # skip mode keeps up with real time (a slot due while a dead runner's claim
    # has not expired yet is recorded skipped); the retry modes run every slot.
    @sched.cron(job, "* * * * * *", on_crash="skip" if mode == "skip" else "retry",
                max_attempts=5, claim_ttl=claim_ttl, transactional=mode == "transactional",
                catch_up="latest" if mode == "skip" else "all", deadline=30)
    async def work(slot: Slot) -> None:
        await pool.execute("insert into job_starts (job, slot_at, attempt, runner)"
                           " values ($1, $2, $3, $4)", slot.job, slot.at, slot.attempt, sched.runner)
        if slot.conn is not None:
            await slot.conn.execute("insert into job_effects (job, slot_at) values ($1, $2)",
                                    slot.job, slot.at)
        await asyncio.sleep(0.4)

    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: asyncio.ensure_future(sched.stop()))
    print("READY", flush=True)
    try:
        await sched.run()
    finally:
        if member is not None:
            await member.close()
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
