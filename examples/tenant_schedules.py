"""Schedules as data: one digest schedule per tenant, added and changed at run time.

    python examples/tenant_schedules.py postgresql://user@host/db [--serve]

Every replica registers the handler ("send-digest"); the schedules themselves are rows
that any replica (or `pgcoord jobs`, or SQL) adds, changes, pauses and removes while
the replicas run. Without --serve it adds three tenants' schedules, changes one, pauses
another, lists them, runs one now with trigger() and removes them again; with --serve it
runs the scheduler until Ctrl-C, picking up changes within a second.
"""

import asyncio
import sys

import asyncpg

import pgcoord


async def main(dsn: str, serve: bool) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    sched = pgcoord.Scheduler(pool)

    @sched.job("send-digest")
    async def digest(slot: pgcoord.Slot) -> None:
        print(f"digest for team {slot.args['team']} ({slot.key})")

    if serve:
        await sched.run()
        return
    names = [f"example:digest:team-{team}" for team in (1, 2, 3)]
    for team, name in zip((1, 2, 3), names, strict=True):
        await sched.add(name, "0 9 * * 1", handler="send-digest", tz="Europe/Paris",
                        args={"team": team})
    await sched.update(names[0], expr="0 10 * * 1")   # a new time, from now on
    await sched.pause(names[1])                       # its slots are recorded skipped
    for info in await sched.schedules():
        if info.name in names:
            print(f"{info.name}: {info.expr} {info.tz}, paused={info.paused},"
                  f" next run {info.next_run_at:%Y-%m-%d %H:%M}Z")
    slot = await sched.trigger(names[2])
    state = await pool.fetchval(
        "select state from pgcoord.job_slots where job = $1 and slot_at = $2", slot.job, slot.at)
    print(f"manual run recorded as {state}")
    for name in names:
        await sched.remove(name)
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], "--serve" in sys.argv))
