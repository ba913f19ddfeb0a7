"""LockHolder: lock/unlock rate, cross-process handoff, and time to LockLost.

    python bench/holder.py [--seconds 1.5] [--rounds 3] [--handoffs 200] [--kills 20]

Prints Markdown tables. The rate compares a LockHolder with the same session
lock written by hand on one dedicated connection of the same driver, measured
in the same run with alternating rounds. The handoff is from a holder in one
process releasing to a holder in another process being granted (Linux's
monotonic clock is system-wide, so both ends read the same clock). The last
table is the time from pg_terminate_backend of the holder's session to its
body being cancelled with LockLost.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncpg
import psycopg

import pgcoord
from bench._server import bench_database


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _rate(op: Callable[[int], Awaitable[None]], seconds: float) -> float:
    count, started = 0, time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        await op(7)
        count += 1
    return count / (time.perf_counter() - started)


async def bench_rate(dsn: str, driver: str, seconds: float, rounds: int) -> tuple[float, float]:
    async with pgcoord.LockHolder(dsn, driver=driver) as holder:
        async def ours(k: int) -> None:
            async with holder.lock(k):
                pass

        if driver == "asyncpg":
            conn: Any = await asyncpg.connect(dsn)

            async def hand(k: int) -> None:
                await conn.fetchval("select pg_advisory_lock($1)", k)
                await conn.fetchval("select pg_advisory_unlock($1)", k)
        else:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)

            async def hand(k: int) -> None:
                await conn.execute("select pg_advisory_lock(%s)", (k,))
                await conn.execute("select pg_advisory_unlock(%s)", (k,))

        for _ in range(50):
            await ours(1)
            await hand(1)
        mine, theirs = [], []
        for _ in range(rounds):
            mine.append(await _rate(ours, seconds))
            theirs.append(await _rate(hand, seconds))
        await conn.close()
    return statistics.median(mine), statistics.median(theirs)


# -- handoff between processes ----------------------------------------------------------

def _waiter_process(dsn: str, rounds: int, pipe: Any) -> None:
    async def main() -> None:
        async with pgcoord.LockHolder(dsn, application_name="bench-waiter") as holder:
            for _ in range(rounds):
                pipe.recv()
                async with holder.lock("bench:handoff"):
                    pipe.send(time.monotonic())

    asyncio.run(main())


async def bench_handoff(dsn: str, rounds: int) -> list[float]:
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_waiter_process, args=(dsn, rounds, child))
    proc.start()
    latencies = []
    probe = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn, application_name="bench-holder") as holder:
            for _ in range(rounds):
                async with holder.lock("bench:handoff"):
                    parent.send("go")
                    while not await probe.fetchval(
                        "select count(*) from pg_locks where locktype = 'advisory' and not granted"
                    ):
                        await asyncio.sleep(0.0005)
                    released_at = time.monotonic()
                granted_at = await asyncio.to_thread(parent.recv)
                latencies.append(granted_at - released_at)
    finally:
        await probe.close()
        proc.join(30)
    return latencies


# -- pg_terminate_backend to LockLost ----------------------------------------------------

async def bench_lost(dsn: str, driver: str, kills: int, keepalive: float) -> list[float]:
    samples = []
    admin = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn, driver=driver, keepalive=keepalive) as holder:
            for _ in range(kills):
                holding = asyncio.Event()

                async def body() -> None:
                    async with holder.lock("bench:lost"):
                        holding.set()
                        await asyncio.sleep(60)

                task = asyncio.create_task(body())
                await holding.wait()
                await asyncio.sleep(random.uniform(0, keepalive))  # anywhere in the probe cycle
                killed_at = time.monotonic()
                await admin.execute("select pg_terminate_backend($1)", holder.backend_pid)
                try:
                    await task
                except pgcoord.LockLost:
                    samples.append(time.monotonic() - killed_at)
    finally:
        await admin.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--handoffs", type=int, default=200)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--keepalive", type=float, default=1.0)
    args = parser.parse_args()
    with bench_database() as (dsn, _):
        print(f"# LockHolder benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, loopback)\n")
        print("| driver | LockHolder lock+unlock/s | hand-written on one connection/s | ratio |")
        print("|---|---:|---:|---:|")
        for driver in ("asyncpg", "psycopg"):
            mine, theirs = asyncio.run(bench_rate(dsn, driver, args.seconds, args.rounds))
            print(f"| {driver} | {mine:,.0f} | {theirs:,.0f} | {mine / theirs:.2f}x |", flush=True)
        lat = asyncio.run(bench_handoff(dsn, args.handoffs))
        print(f"\nHandoff between two processes' holders ({len(lat)} samples): "
              f"p50 {pct(lat, 0.5) * 1000:.2f} ms, p99 {pct(lat, 0.99) * 1000:.2f} ms\n")
        print(f"| driver | pg_terminate_backend to LockLost, p50 | p99 | keepalive |")
        print("|---|---:|---:|---:|")
        for driver in ("asyncpg", "psycopg"):
            lost = asyncio.run(bench_lost(dsn, driver, args.kills, args.keepalive))
            print(f"| {driver} | {pct(lost, 0.5) * 1000:.1f} ms | {pct(lost, 0.99) * 1000:.1f} ms | "
                  f"{args.keepalive:g} s |", flush=True)


if __name__ == "__main__":
    main()
