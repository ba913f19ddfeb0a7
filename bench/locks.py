"""exclusive() against hand-written driver code, measured in the same run.

    python bench/locks.py [--seconds 0.4] [--rounds 31] [--latency-ms 0.5]

Prints a Markdown table: uncontended acquire+release per second for each
driver with 1 and 4 concurrent clients, pgcoord and the hand-written
``BEGIN; SELECT pg_advisory_xact_lock(k); COMMIT`` done the way a user of that
driver would write it, their ratio, pgbench's figure for the same SQL as the C
floor, and the handoff latency from a holder's release to a waiter's grant; then
the same table again through a proxy that delays each direction, as a network
between an application and its database does.
Each round measures both implementations back to back, in alternating order, and
the ratio reported is the median of the rounds' ratios, with the middle half of
them beside it, so that drift on a shared machine hits both alike and the
noise that is left is on show.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncpg
import psycopg
import psycopg_pool
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord
from bench._latency import DelayingProxy
from bench._server import bench_database
from pgcoord._core.embedded import find_bindir

LOCK_SQL = "select pg_advisory_xact_lock({k})"


def _url(dsn: str, driver: str) -> str:
    return dsn.replace("postgresql://", f"postgresql+{driver}://")


Row = tuple[str, float, float, list[float]]


def _summary(name: str, mine: list[float], theirs: list[float]) -> Row:
    """Median rates, and the per-round ratios."""
    ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
    return name, statistics.median(mine), statistics.median(theirs), ratios


# -- async drivers -----------------------------------------------------------------

async def _async_rate(op: Callable[[int], Awaitable[None]], clients: int, seconds: float) -> float:
    deadline = time.perf_counter() + seconds
    counts = [0] * clients

    async def client(i: int) -> None:
        key = 1000 + i
        while time.perf_counter() < deadline:
            await op(key)
            counts[i] += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return sum(counts) / (time.perf_counter() - started)


Source = tuple[Any, Callable[[int], Any], Callable[[], Awaitable[None]]]


async def _open_asyncpg(dsn: str, clients: int) -> Source:
    pool = await asyncpg.create_pool(dsn, min_size=clients, max_size=clients)

    async def by_hand(k: int) -> None:
        async with pool.acquire() as c, c.transaction():
            await c.execute("select pg_advisory_xact_lock($1)", k)

    return pool, by_hand, pool.close


async def _open_psycopg(dsn: str, clients: int) -> Source:
    pool = psycopg_pool.AsyncConnectionPool(dsn, min_size=clients, max_size=clients, open=False)
    await pool.open(wait=True)

    async def by_hand(k: int) -> None:
        async with pool.connection() as c, c.transaction():
            await c.execute("select pg_advisory_xact_lock(%s)", (k,))

    return pool, by_hand, pool.close


async def _open_sqlalchemy(dsn: str, clients: int) -> Source:
    engine = create_async_engine(_url(dsn, "asyncpg"), pool_size=clients)

    async def by_hand(k: int) -> None:
        async with engine.begin() as c:
            await c.execute(text("select pg_advisory_xact_lock(:k)"), {"k": k})

    return engine, by_hand, engine.dispose


# One driver's pool at a time: another's idle pool and objects would weigh on it.
ASYNC_SOURCES = {
    "asyncpg Pool": _open_asyncpg,
    "psycopg AsyncConnectionPool": _open_psycopg,
    "SQLAlchemy AsyncEngine (asyncpg)": _open_sqlalchemy,
}


async def bench_async(
    dsn: str, clients: int, seconds: float, rounds: int,
) -> list[Row]:
    results = []
    for name, open_source in ASYNC_SOURCES.items():
        source, hand, close = await open_source(dsn, clients)

        async def ours(k: int, source: Any = source) -> None:
            async with pgcoord.exclusive(source, k):
                pass

        for _ in range(20):  # warm pools and caches
            await ours(1), await hand(1)
        gc.collect()
        mine, theirs = [], []
        for round_no in range(rounds):
            pair = [(ours, mine), (hand, theirs)]
            for op, into in pair if round_no % 2 == 0 else pair[::-1]:
                into.append(await _async_rate(op, clients, seconds))
        await close()
        results.append(_summary(name, mine, theirs))
    return results


# -- sync drivers --------------------------------------------------------------------

def _sync_rate(op: Callable[[int], None], clients: int, seconds: float) -> float:
    deadline = time.perf_counter() + seconds
    counts = [0] * clients

    def client(i: int) -> None:
        key = 2000 + i
        while time.perf_counter() < deadline:
            op(key)
            counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def bench_sync(dsn: str, clients: int, seconds: float, rounds: int) -> list[Row]:
    pool = psycopg_pool.ConnectionPool(dsn, min_size=clients, max_size=clients, open=True)

    def psycopg_hand(k: int) -> None:
        with pool.connection() as c, c.transaction():
            c.execute("select pg_advisory_xact_lock(%s)", (k,))

    engine = create_engine(_url(dsn, "psycopg"), pool_size=clients)

    def sa_hand(k: int) -> None:
        with engine.begin() as c:
            c.execute(text("select pg_advisory_xact_lock(:k)"), {"k": k})

    results = []
    for name, source, hand, close in (
        ("psycopg ConnectionPool", pool, psycopg_hand, pool.close),
        ("SQLAlchemy Engine (psycopg)", engine, sa_hand, engine.dispose),
    ):
        def ours(k: int, source: Any = source) -> None:
            with pgcoord.exclusive(source, k):
                pass

        for _ in range(20):
            ours(1), hand(1)
        gc.collect()
        mine, theirs = [], []
        for round_no in range(rounds):
            pair = [(ours, mine), (hand, theirs)]
            for op, into in pair if round_no % 2 == 0 else pair[::-1]:
                into.append(_sync_rate(op, clients, seconds))
        close()
        results.append(_summary(name, mine, theirs))
    return results


# -- the C floor and handoff ---------------------------------------------------------------

def pgbench_floor(dsn: str, clients: int, seconds: float) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as script:
        script.write("\\set k random(1, 1000000)\nBEGIN;\nSELECT pg_advisory_xact_lock(:k);\nCOMMIT;\n")
    try:
        out = subprocess.run(
            [str(find_bindir() / "pgbench"), "-n", "-f", script.name, "-c", str(clients),
             "-j", str(min(clients, 2)), "-T", str(max(1, round(seconds * 2))), dsn],
            capture_output=True, text=True, check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    match = re.search(r"tps = ([\d.]+)", out)
    return float(match.group(1)) if match else float("nan")


async def handoff(dsn: str, samples: int) -> list[float]:
    """Release-to-grant latency between two sessions of one asyncpg pool."""
    pool = await asyncpg.create_pool(dsn, min_size=3, max_size=3)
    latencies = []
    try:
        async with pool.acquire() as probe:
            for _ in range(samples):
                released_at = 0.0
                granted = asyncio.Event()
                holding = asyncio.Event()
                go = asyncio.Event()

                async def holder() -> None:
                    nonlocal released_at
                    async with pgcoord.exclusive(pool, "bench:handoff"):
                        holding.set()
                        await go.wait()
                        released_at = time.perf_counter()

                async def waiter() -> float:
                    async with pgcoord.exclusive(pool, "bench:handoff"):
                        return time.perf_counter()

                h = asyncio.create_task(holder())
                await holding.wait()
                w = asyncio.create_task(waiter())
                while not await probe.fetchval(
                    "select count(*) from pg_locks where locktype='advisory' and not granted"
                ):
                    await asyncio.sleep(0.0005)
                go.set()
                await h
                latencies.append(await w - released_at)
                granted.set()
    finally:
        await pool.close()
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _table(dsn: str, seconds: float, rounds: int) -> None:
    print("| driver | clients | pgcoord acq+rel/s | hand-written/s | ratio (median) | "
          "middle half of rounds | pgbench (C floor) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for clients in (1, 4):
        floor = pgbench_floor(dsn, clients, seconds)
        rows = asyncio.run(bench_async(dsn, clients, seconds, rounds))
        rows += bench_sync(dsn, clients, seconds, rounds)
        for name, mine, theirs, ratios in rows:
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            print(f"| {name} | {clients} | {mine:,.0f} | {theirs:,.0f} | {median:.2f}x | "
                  f"{q1:.2f}–{q3:.2f} | {floor:,.0f} |", flush=True)


def _round_trip_ms(dsn: str, samples: int = 200) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select 1")
        times = []
        for _ in range(samples):
            started = time.perf_counter()
            conn.execute("select 1")
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    parser.add_argument("--rounds", type=int, default=31, help="alternating rounds per pair")
    parser.add_argument("--handoffs", type=int, default=300)
    parser.add_argument("--latency-ms", type=float, default=0.5,
                        help="one-way delay for the second table, through a delaying proxy (0: skip)")
    args = parser.parse_args()

    with bench_database() as (dsn, _):
        print(f"# exclusive() benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
              f"medians of {args.rounds} alternating rounds of {args.seconds}s)\n")
        print(f"## Loopback (round trip of `select 1`: {_round_trip_ms(dsn):.3f} ms)\n")
        _table(dsn, args.seconds, args.rounds)
        lat = asyncio.run(handoff(dsn, args.handoffs))
        print(f"\nHandoff, holder's release to waiter's grant (asyncpg pool, {len(lat)} samples): "
              f"p50 {pct(lat, 0.5) * 1000:.2f} ms, p99 {pct(lat, 0.99) * 1000:.2f} ms")
        if args.latency_ms > 0:
            host_port = dsn.split("@", 1)[1].split("/", 1)[0]
            proxy = DelayingProxy("127.0.0.1", int(host_port.rsplit(":", 1)[1]),
                                  args.latency_ms / 1000)
            try:
                slow = proxy.dsn(dsn)
                print(f"\n## Through a proxy delaying {args.latency_ms} ms each way (round trip of "
                      f"`select 1`: {_round_trip_ms(slow):.3f} ms)\n")
                _table(slow, args.seconds, args.rounds)
            finally:
                proxy.close()


if __name__ == "__main__":
    main()
