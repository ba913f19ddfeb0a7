"""Semaphores: acquire+release rate against exclusive() on one key, and release-to-grant.

    python bench/semaphore.py [--seconds 0.3] [--rounds 11] [--handoffs 200]

Prints Markdown tables. The rate table compares ``pgcoord.semaphore(pool, name,
limit=5)`` with ``pgcoord.exclusive(pool, key)`` on the same pool (one client,
an empty body), and ``holder.semaphore()`` with ``holder.lock()`` on one
LockHolder: each round measures both back to back, in alternating order, and
the ratio reported is that of the two medians shown, with the middle half of
the rounds' own ratios beside it. The handoff table is the time from a holder in this process
letting go of the only slot (limit 1; the instant is read just before leaving
the ``async with``, so it includes the COMMIT or unlock round trip) to a waiter
in another process holding it (Linux's monotonic clock is system-wide). A
waiter also retries every SEMAPHORE_RECHECK (0.5 s) for crashed holders; a
handoff that took that path would show as about 0.5 s in the max column.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncpg
import psycopg_pool

import pgcoord
from bench._server import bench_database
from pgcoord.keys import semaphore_key


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- acquire+release rate --------------------------------------------------------------

async def _rate(op: Callable[[], Awaitable[None]], seconds: float) -> float:
    count, started = 0, time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        await op()
        count += 1
    return count / (time.perf_counter() - started)


async def _compare(ours: Callable[[], Awaitable[None]], theirs: Callable[[], Awaitable[None]],
                   seconds: float, rounds: int) -> tuple[float, float, list[float]]:
    for _ in range(50):
        await ours()
        await theirs()
    mine, base = [], []
    for i in range(rounds):
        if i % 2:
            base.append(await _rate(theirs, seconds))
            mine.append(await _rate(ours, seconds))
        else:
            mine.append(await _rate(ours, seconds))
            base.append(await _rate(theirs, seconds))
    return statistics.median(mine), statistics.median(base), [
        m / t for m, t in zip(mine, base, strict=True)]


async def bench_rates(dsn: str, seconds: float, rounds: int) -> list[tuple[str, float, float, list[float]]]:
    rows = []
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)
    try:
        async def sem() -> None:
            async with pgcoord.semaphore(pool, "bench:sem", limit=5):
                pass

        async def lock() -> None:
            async with pgcoord.exclusive(pool, "bench:sem-lock"):
                pass

        rows.append(("asyncpg pool: semaphore() vs exclusive()",
                     *await _compare(sem, lock, seconds, rounds)))
    finally:
        await pool.close()
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False) as ppool:
        async def psem() -> None:
            async with pgcoord.semaphore(ppool, "bench:sem", limit=5):
                pass

        async def plock() -> None:
            async with pgcoord.exclusive(ppool, "bench:sem-lock"):
                pass

        rows.append(("psycopg pool: semaphore() vs exclusive()",
                     *await _compare(psem, plock, seconds, rounds)))
    async with pgcoord.LockHolder(dsn) as holder:
        async def hsem() -> None:
            async with holder.semaphore("bench:sem", limit=5):
                pass

        async def hlock() -> None:
            async with holder.lock("bench:sem-lock"):
                pass

        rows.append(("LockHolder (asyncpg): holder.semaphore() vs holder.lock()",
                     *await _compare(hsem, hlock, seconds, rounds)))
    return rows


# -- release to grant, across processes --------------------------------------------------

def _slot(scope: str, pool: Any, holder: Any, name: str) -> Any:
    if scope == "session":
        return holder.semaphore(name, limit=1)
    return pgcoord.semaphore(pool, name, limit=1)


def _waiter_process(dsn: str, scope: str, name: str, rounds: int, pipe: Any) -> None:
    async def main() -> None:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        async with pgcoord.LockHolder(dsn, application_name="bench-waiter") as holder:
            for _ in range(rounds):
                await asyncio.to_thread(pipe.recv)
                async with _slot(scope, pool, holder, name):
                    pipe.send(time.monotonic())
        await pool.close()

    asyncio.run(main())


async def bench_handoff(dsn: str, scope: str, rounds: int) -> list[float]:
    name = f"bench:handoff:{scope}"
    key = semaphore_key(name)
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_waiter_process,
                                           args=(dsn, scope, name, rounds, child))
    proc.start()
    latencies = []
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    probe = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn, application_name="bench-holder") as holder:
            for _ in range(rounds):
                slot = _slot(scope, pool, holder, name)
                async with slot:
                    parent.send("go")
                    # Until the waiter is in the waiting room: it has tried, and listens.
                    while not await probe.fetchval(  # noqa: ASYNC110 - polls the server
                        "select count(*) from pg_locks where locktype = 'advisory'"
                        " and objsubid = 2 and classid = ($1::bigint & 4294967295)::oid"
                        " and objid = 4294967295::oid", key,
                    ):
                        await asyncio.sleep(0.0005)
                    released_at = time.monotonic()
                granted_at = await asyncio.to_thread(parent.recv)
                latencies.append(granted_at - released_at)
    finally:
        await probe.close()
        await pool.close()
        proc.join(30)
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="per measurement")
    parser.add_argument("--rounds", type=int, default=11, help="alternating rounds per pair")
    parser.add_argument("--handoffs", type=int, default=200)
    args = parser.parse_args()
    logging.getLogger("pgcoord").setLevel(logging.ERROR)
    with bench_database() as (dsn, _):
        print(f"# Semaphore benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
              "loopback)\n")
        print("Server: pgcoord's embedded test server (fsync off, synchronous_commit off),"
              " so a commit costs no disk flush.\n")
        print("| one client, empty body | semaphore acq+rel/s | lock acq+rel/s | "
              "ratio | per-round ratios, middle half |")
        print("|---|---:|---:|---:|---:|")
        for label, mine, base, ratios in asyncio.run(bench_rates(dsn, args.seconds, args.rounds)):
            # The ratio of the two medians shown; each round's own ratio varies with
            # the machine's load, so their middle half is given beside it.
            q1, _median, q3 = statistics.quantiles(ratios, n=4)
            print(f"| {label} | {mine:,.0f} | {base:,.0f} | {mine / base:.2f}x | "
                  f"{q1:.2f}-{q3:.2f} |", flush=True)
        print("\n| release to grant, other process | samples | p50 ms | p99 ms | max ms |")
        print("|---|---:|---:|---:|---:|")
        for scope, label in (("xact", "pgcoord.semaphore() (asyncpg pool)"),
                             ("session", "holder.semaphore() (waiting connection)")):
            lat = asyncio.run(bench_handoff(dsn, scope, args.handoffs))
            print(f"| {label} | {len(lat)} | {pct(lat, 0.5) * 1000:.2f} | "
                  f"{pct(lat, 0.99) * 1000:.2f} | {max(lat) * 1000:.2f} |", flush=True)


if __name__ == "__main__":
    main()
