"""A run-once nightly job in a time zone, on every replica, run once per night in all.

    python examples/nightly_job.py postgresql://user@host/db [--serve]

Without --serve it shows the next runs (across the DST change, in Berlin time) and runs
the job once now with trigger(); with --serve it runs the scheduler until Ctrl-C.
"""

import asyncio
import sys
from zoneinfo import ZoneInfo

import asyncpg

import pgcoord

BERLIN = ZoneInfo("Europe/Berlin")


async def main(dsn: str, serve: bool) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    sched = pgcoord.Scheduler(pool)

    @sched.cron("example:nightly-report", "30 2 * * *", tz="Europe/Berlin", on_crash="retry")
    async def nightly(slot: pgcoord.Slot) -> None:
        print(f"building the report for slot {slot.key} (attempt {slot.attempt})")

    for at in sched.next_runs("example:nightly-report", 3):
        print("next run:", at.astimezone(BERLIN).isoformat())
    if serve:
        await sched.run()
    else:
        slot = await sched.trigger("example:nightly-report")
        state = await pool.fetchval(
            "select state from pgcoord.job_slots where job = $1 and slot_at = $2", slot.job, slot.at)
        print(f"manual run recorded as {state}")
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--serve" in sys.argv))
