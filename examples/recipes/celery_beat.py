"""Replace Celery beat: every replica runs a pgcoord Scheduler, and each slot's job
enqueues its Celery task once, whichever replica wins the slot.

    python examples/recipes/celery_beat.py postgresql://user@host/db   (broker: CELERY_BROKER_URL)

Beat itself must run as exactly one process (two beats enqueue everything twice). Here
any number of replicas run the schedule; the table pgcoord.job_slots lets one of them
claim each slot, and every slot ends as a row with its state.

Once per slot: a slot's job runs once (on_crash="skip": a replica that dies mid-slot
gets it recorded ``abandoned``, not run again). A replica that dies after enqueueing and
before recording still enqueued once. The task id is the slot's key, so a consumer can
also drop a duplicate should one ever be sent some other way.
"""

from __future__ import annotations

import asyncio
import os
import sys

import asyncpg
from celery import Celery

import pgcoord

celery_app = Celery("recipes", broker=os.environ.get("CELERY_BROKER_URL", "memory://"))


@celery_app.task(name="recipes.send_digest")
def send_digest(slot_key: str) -> str:
    return f"digest for {slot_key}"


def make_scheduler(pool: asyncpg.Pool, expr: str = "0 9 * * *") -> pgcoord.Scheduler:
    sched = pgcoord.Scheduler(pool)

    @sched.cron("recipes:send-digest", expr, on_crash="skip")
    async def enqueue(slot: pgcoord.Slot) -> None:
        # Celery's send is blocking I/O: off the event loop.
        await asyncio.to_thread(send_digest.apply_async, args=[slot.key], task_id=slot.key)

    return sched


async def main(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        await make_scheduler(pool).run()
    finally:
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
