"""LockHolder: lock/unlock rate, cross-process handoff, and time to LockLost.

    python bench/holder.py [--seconds 0.4] [--rounds 21] [--latency-ms 0.5]
                           [--handoffs 200] [--kills 20] [--keepalive 1.0]

Prints Markdown tables. The rate compares a LockHolder with the same session
lock written by hand on one dedicated connection of the same driver
(``select pg_advisory_lock``, then ``select pg_advisory_unlock``): each round
measures both back to back, in alternating order, and the ratio reported is the
median of the rounds' ratios with the middle half of them beside it, so that
drift on a shared machine hits both alike. The second rate table goes through
a proxy that delays each direction (``bench/_latency.py``), as a network
between an application and its database does. The handoff is from a holder in
one process releasing to a holder in another process being granted (Linux's
monotonic clock is system-wide, so both ends read the same clock). The last
table is the time from pg_terminate_backend of the holder's session to its
body being cancelled with LockLost, killed at a random point of the probe cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
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
from bench._latency import DelayingProxy
from bench._server import bench_database


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- lock+unlock rate --------------------------------------------------------------------

async def _rate(op: Callable[[int], Awaitable[None]], seconds: float) -> float:
    count, started = 0, time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        await op(7)
        count += 1
    return count / (time.perf_counter() - started)


async def bench_rate(
    dsn: str, driver: str, seconds: float, rounds: int,
) -> tuple[float, float, list[float]]:
    """Median rates of LockHolder and of the hand-written pair, and the per-round ratios."""
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
        for i in range(rounds):
            if i % 2:
                theirs.append(await _rate(hand, seconds))
                mine.append(await _rate(ours, seconds))
            else:
                mine.append(await _rate(ours, seconds))
                theirs.append(await _rate(hand, seconds))
        await conn.close()
    ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
    return statistics.median(mine), statistics.median(theirs), ratios


def _round_trip_ms(dsn: str, samples: int = 200) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select 1")
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            conn.execute("select 1")
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def _rate_table(dsn: str, seconds: float, rounds: int) -> None:
    print("| driver | LockHolder lock+unlock/s | hand-written on one connection/s | "
          "ratio (median) | middle half of rounds |")
    print("|---|---:|---:|---:|---:|")
    for driver in ("asyncpg", "psycopg"):
        mine, theirs, ratios = asyncio.run(bench_rate(dsn, driver, seconds, rounds))
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        print(f"| {driver} | {mine:,.0f} | {theirs:,.0f} | {median:.2f}x | {q1:.2f}-{q3:.2f} |",
              flush=True)


# -- handoff between processes ----------------------------------------------------------

def _waiter_process(dsn: str, rounds: int, pipe: Any) -> None:
    async def main() -> None:
        async with pgcoord.LockHolder(dsn, application_name="bench-waiter") as holder:
            for _ in range(rounds):
                # In a thread: a blocked event loop would also hold back the
                # previous round's unlock, which goes out on the loop's next turn.
                await asyncio.to_thread(pipe.recv)
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
                    while not await probe.fetchval(  # noqa: ASYNC110 - polls the server
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

                async def body(holding: asyncio.Event = holding) -> None:
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
    parser.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    parser.add_argument("--rounds", type=int, default=21, help="alternating rounds per pair")
    parser.add_argument("--latency-ms", type=float, default=0.5,
                        help="one-way delay for the second rate table (0: skip)")
    parser.add_argument("--handoffs", type=int, default=200)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--keepalive", type=float, default=1.0)
    args = parser.parse_args()
    logging.getLogger("pgcoord").setLevel(logging.ERROR)  # each kill logs a lost session
    with bench_database() as (dsn, _):
        print(f"# LockHolder benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
              f"medians of {args.rounds} alternating rounds of {args.seconds}s)\n")
        print(f"## Loopback (round trip of `select 1`: {_round_trip_ms(dsn):.3f} ms)\n")
        _rate_table(dsn, args.seconds, args.rounds)
        if args.latency_ms > 0:
            host_port = dsn.split("@", 1)[1].split("/", 1)[0]
            proxy = DelayingProxy("127.0.0.1", int(host_port.rsplit(":", 1)[1]),
                                  args.latency_ms / 1000)
            try:
                slow = proxy.dsn(dsn)
                print(f"\n## Through a proxy delaying {args.latency_ms} ms each way (round trip "
                      f"of `select 1`: {_round_trip_ms(slow):.3f} ms)\n")
                _rate_table(slow, args.seconds, args.rounds)
            finally:
                proxy.close()
        lat = asyncio.run(bench_handoff(dsn, args.handoffs))
        print(f"\n## Handoff between two processes' holders ({len(lat)} samples): "
              f"p50 {pct(lat, 0.5) * 1000:.2f} ms, p99 {pct(lat, 0.99) * 1000:.2f} ms\n")
        print("| driver | pg_terminate_backend to LockLost, p50 | p99 | max | keepalive |")
        print("|---|---:|---:|---:|---:|")
        for driver in ("asyncpg", "psycopg"):
            lost = asyncio.run(bench_lost(dsn, driver, args.kills, args.keepalive))
            print(f"| {driver} | {pct(lost, 0.5) * 1000:.1f} ms | {pct(lost, 0.99) * 1000:.1f} ms "
                  f"| {max(lost) * 1000:.1f} ms | {args.keepalive:g} s |", flush=True)


if __name__ == "__main__":
    main()
