"""One replica for the high-availability tests and bench/ha.py, run as its own process.

    python ha_replica.py DRIVER POOL_DSN DIRECT_DSN PREFIX LABEL TTL

Every feature at once, each through multi-host DSNs that follow the primary:

* an ``Elector`` of its own (DIRECT_DSN) and one on a ``Member``, each leading
  ``PREFIX:elector`` / ``PREFIX:member-elector``; the plain one makes a fenced
  write into ``ha_writes`` every 20 ms while it leads;
* a ``LockHolder`` of its own and one on the member, each holding a lock of this
  replica's (``PREFIX:lock:LABEL``, ``PREFIX:mlock:LABEL``) in a body that runs
  until the lock is lost, then takes it again;
* a ``Lease`` on the pool, ``PREFIX:lease``, whose holder makes fenced writes;
* a ``Scheduler`` on the pool with a per-second job ``PREFIX:job`` that records
  each start in ``ha_starts`` and works for 0.3 s;
* with ``HA_REPLICA_MEMBER_FEATURES=1`` (the Patroni tests), also a member lease
  (``Lease(pool, PREFIX:mlease, member=member)``) whose holder makes fenced writes,
  and ``Partitions(member, PREFIX:parts, count=4)``, each own() printing ``own`` and
  ``unowned`` events named ``PREFIX:parts/INDEX``.

DRIVER is ``asyncpg``, ``psycopg`` or ``sqlalchemy`` (an ``AsyncEngine`` on POOL_DSN;
the sessions then use asyncpg on DIRECT_DSN). Events go to stdout as
``EVENT <unix time> <what> <name> <fence>``; on SIGUSR1 the replica prints what it
believes it holds as ``STATE <json>``; SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pgcoord
from pgcoord.scheduler import Scheduler, Slot

Write = Callable[[str, int], Awaitable[None]]
Execute = Callable[[str, tuple[Any, ...]], Awaitable[None]]


def event(what: str, name: str, fence: object = "-") -> None:
    print(f"EVENT {time.time():.6f} {what} {name} {fence}", flush=True)


async def make_pool(driver: str, dsn: str) -> tuple[Any, Write, Execute]:
    """The pool, a fenced write, and a plain autocommit insert, for ``driver``."""
    insert = "insert into ha_writes (name, replica, fence) values ({0}, {1}, {2})"
    if driver == "asyncpg":
        import asyncpg

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=6)

        async def write(name: str, fence: int) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, name, fence)
                await conn.execute(insert.format("$1", "$2", "$3"), name, LABEL, fence)

        async def execute(sql: str, args: tuple[Any, ...]) -> None:
            await pool.execute(sql.replace("%s", "${}").format(*range(1, len(args) + 1)), *args)
        return pool, write, execute
    if driver == "psycopg":
        from psycopg_pool import AsyncConnectionPool

        ppool = AsyncConnectionPool(dsn, min_size=1, max_size=6, open=False,
                                    kwargs={"autocommit": True}, timeout=5)
        await ppool.open()

        async def pwrite(name: str, fence: int) -> None:
            async with ppool.connection() as conn, conn.transaction():
                await pgcoord.check_fence(conn, name, fence)
                await conn.execute(insert.format("%s", "%s", "%s"), (name, LABEL, fence))

        async def pexecute(sql: str, args: tuple[Any, ...]) -> None:
            async with ppool.connection() as conn:
                await conn.execute(sql, args)
        return ppool, pwrite, pexecute
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(dsn, pool_size=6, max_overflow=0, pool_timeout=5,
                                 pool_pre_ping=True)

    async def swrite(name: str, fence: int) -> None:
        async with engine.begin() as conn:
            await pgcoord.check_fence(conn, name, fence)
            await conn.execute(text(insert.format(":n", ":r", ":f")), {"n": name, "r": LABEL, "f": fence})

    async def sexecute(sql: str, args: tuple[Any, ...]) -> None:
        names = [f"p{i}" for i in range(len(args))]
        async with engine.begin() as conn:
            await conn.execute(text(sql.replace("%s", "{}").format(*(":" + n for n in names))),
                               dict(zip(names, args, strict=True)))
    return engine, swrite, sexecute


async def close_pool(pool: Any) -> None:
    close = getattr(pool, "dispose", None) or pool.close
    await close()


async def forever(what: str, name: str, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` again whenever it ends on a loss or a database error."""
    while True:
        try:
            await body()
        except pgcoord.LockLost as exc:  # LeaseLost too
            event(what + "-lost", name, type(exc).__name__)
        except Exception as exc:  # the database is away: try again
            event(what + "-error", name, f"{type(exc).__name__}:{exc}"[:120].replace(" ", "_"))
        await asyncio.sleep(0.1)


async def main(driver: str, pool_dsn: str, direct_dsn: str, prefix: str, ttl: float) -> None:
    session_driver = "psycopg" if driver == "psycopg" else "asyncpg"
    pool, write, execute = await make_pool(driver, pool_dsn)
    state: dict[str, Any] = {}

    async def fenced_writes(name: str, fence: int) -> None:
        failing = True  # until the term's first write is accepted
        while True:
            try:
                await write(name, fence)
                if failing:
                    # The term's first write accepted, or the first after errors.
                    event("resumed", name, fence)
                failing = False
            except pgcoord.StaleFence:
                event("rejected", name, fence)
            except Exception:
                failing = True  # the server is away; the lease's own loss cancels us
            await asyncio.sleep(0.02)

    def leader(name: str, writes: bool) -> Callable[[int], Awaitable[None]]:
        async def lead(fence: int) -> None:
            event("lead", name, fence)
            try:
                if writes:
                    await fenced_writes(name, fence)
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                event("cancelled", name, fence)
                raise
        return lead

    member = pgcoord.Member(direct_dsn, group=prefix, name=LABEL, ttl=ttl, driver=session_driver)
    await member.open()
    elector = pgcoord.Elector(direct_dsn, f"{prefix}:elector", ttl=ttl, holder=LABEL, driver=session_driver)
    m_elector = pgcoord.Elector(member, f"{prefix}:member-elector", ttl=ttl)
    holder = pgcoord.LockHolder(direct_dsn, driver=session_driver, keepalive=ttl)
    m_holder = pgcoord.LockHolder(member)
    await holder.open()
    await m_holder.open()

    def locked(h: pgcoord.LockHolder, key: str) -> Callable[[], Awaitable[None]]:
        async def body() -> None:
            async with h.lock(key):
                state[key] = True
                event("locked", key)
                try:
                    await asyncio.Event().wait()
                finally:
                    state[key] = False
        return body

    lease_name = f"{prefix}:lease"
    current_lease: list[pgcoord.Lease] = []

    async def lease_body() -> None:
        lease = pgcoord.Lease(pool, lease_name, ttl=ttl, holder=LABEL)
        current_lease[:] = [lease]
        async with lease as fence:
            event("lease", lease_name, fence)
            await fenced_writes(lease_name, fence)

    owned: dict[int, int] = {}  # part index -> fence, while own() runs
    extra: list[Awaitable[None]] = []
    if os.environ.get("HA_REPLICA_MEMBER_FEATURES") == "1":
        mlease_name = f"{prefix}:mlease"

        async def mlease_body() -> None:
            async with pgcoord.Lease(pool, mlease_name, ttl=ttl, holder=LABEL, member=member) as fence:
                event("lease", mlease_name, fence)
                await fenced_writes(mlease_name, fence)

        async def own(part: pgcoord.Partition) -> None:
            owned[part.index] = part.fence
            event("own", f"{prefix}:parts/{part.index}", part.fence)
            try:
                await asyncio.Event().wait()
            finally:
                owned.pop(part.index, None)
                event("unowned", f"{prefix}:parts/{part.index}", part.fence)

        parts = pgcoord.Partitions(member, f"{prefix}:parts", count=4)
        extra = [forever("lease", mlease_name, mlease_body), parts.run(own)]

    sched = Scheduler(pool, runner=LABEL, tick=0.2)

    @sched.cron(f"{prefix}:job", "* * * * * *", on_crash="skip", catch_up="all", deadline=60,
                claim_ttl=ttl)
    async def work(slot: Slot) -> None:
        await execute("insert into ha_starts (slot_at, runner) values (%s, %s)", (slot.at, LABEL))
        event("slot", slot.job, slot.at.timestamp())
        await asyncio.sleep(0.3)

    def report() -> None:
        lease = current_lease[0] if current_lease else None
        print("STATE " + json.dumps({
            "elector": elector.fence if elector.is_leader else None,
            "member-elector": m_elector.fence if m_elector.is_leader else None,
            "lease": lease.fence if lease is not None and lease.valid else None,
            "locks": sorted(k for k, held in state.items() if held),
            "parts": sorted(owned),
        }), flush=True)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, report)
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    tasks = [
        asyncio.create_task(elector.run(leader(f"{prefix}:elector", writes=True))),
        asyncio.create_task(m_elector.run(leader(f"{prefix}:member-elector", writes=False))),
        asyncio.create_task(forever("lock", f"{prefix}:lock:{LABEL}",
                                    locked(holder, f"{prefix}:lock:{LABEL}"))),
        asyncio.create_task(forever("lock", f"{prefix}:mlock:{LABEL}",
                                    locked(m_holder, f"{prefix}:mlock:{LABEL}"))),
        asyncio.create_task(forever("lease", lease_name, lease_body)),
        asyncio.create_task(sched.run()),
        *(asyncio.create_task(coro) for coro in extra),
    ]
    for task in tasks:
        # Nothing may end run() (or a body's retry loop): say so if one ends.
        task.add_done_callback(lambda t: done.is_set() or event("ended", prefix, repr(
            t.exception() if not t.cancelled() else "cancelled")[:120].replace(" ", "_")))
    print("READY", flush=True)
    await done.wait()
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5)
    await m_holder.close()
    await holder.close()
    await member.close()
    await close_pool(pool)


if __name__ == "__main__":
    import faulthandler

    # SIGUSR2: every thread's stack, to tell where a replica that went silent is stuck.
    faulthandler.register(signal.SIGUSR2)
    LABEL = sys.argv[5]
    # pgcoord's warnings (a leader stepping down, and why) with the events' clock.
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                        format="LOG %(created).6f %(name)s %(levelname)s %(message)s")
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[6])))
