"""The dashboard at scale: 10,000 schedules, 1,000 held locks, 100 members.

    python bench/web.py [--schedules 10000] [--locks 1000] [--members 100] [--rounds 30]

One table: the sampler's reading (what a process pays once a second while pages are
open), the server-side render of each page from a sample (the < 100 ms target is the
overview's), and a whole GET / through the ASGI app; baselines from the same run: a
`SELECT 1` round trip and `pgcoord status`'s own query (pgcoord.holders). Then 50
open pages on a real uvicorn server: how many readings they cost in 5 s, and how many
samplers ran.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import asyncpg  # noqa: E402
import httpx  # noqa: E402

import pgcoord  # noqa: E402
import pgcoord.web  # noqa: E402
from bench._server import bench_database  # noqa: E402
from pgcoord._core.queries import query  # noqa: E402
from pgcoord.web import model  # noqa: E402
from pgcoord.web.reader import Reader  # noqa: E402
from pgcoord.web.sample import SchedulesKept, read_sample  # noqa: E402
from pgcoord.web.views import render  # noqa: E402


async def populate(dsn: str, schedules: int, locks: int) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
    await conn.execute(
        "insert into pgcoord.schedules (name, handler, expr, tz) select 'bench-' || g, 'h-' || (g % 50),"
        " case when g % 3 = 0 then '*/5 * * * *' else '0 * * * *' end, 'UTC'"
        f" from generate_series(1, {schedules}) as g")
    # Ten slots of history each, a few failed: the per-schedule lookups meet real rows.
    await conn.execute(
        "insert into pgcoord.job_slots (job, slot_at, state, attempt, started_at, finished_at)"
        " select 'bench-' || g, date_trunc('hour', now()) - make_interval(hours => h),"
        " case when g % 97 = 0 and h < 3 then 'failed' else 'succeeded' end, 1, now(), now()"
        f" from generate_series(1, {schedules}) as g, generate_series(1, 10) as h")
    await conn.execute("analyze pgcoord.job_slots; analyze pgcoord.schedules")
    holder = await asyncpg.connect(dsn, server_settings={"application_name": "bench-holder"})
    await holder.execute(
        "insert into pgcoord.lock_names (key, name) select pgcoord.lock_key('bench-lock-' || g), 'bench-lock-' || g"
        f" from generate_series(1, {locks}) as g on conflict do nothing")
    await holder.execute(f"select pg_catalog.pg_advisory_lock(pgcoord.lock_key('bench-lock-' || g))"
                         f" from generate_series(1, {locks}) as g")
    await conn.close()
    return holder


async def timed(fn: Callable[[], Awaitable[Any]], rounds: int) -> list[float]:
    await fn()  # warm
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        await fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def row(what: str, ms: list[float], base: float | None) -> str:
    p50 = statistics.median(ms)
    p95 = sorted(ms)[max(0, int(len(ms) * 0.95) - 1)]
    ratio = f"{p50 / base:7.1f}x" if base else "      -"
    return f"| {what:<46} | {p50:8.2f} | {p95:8.2f} | {ratio} |"


async def fifty_pages(dsn: str, pages: int, seconds: float) -> tuple[int, int, int]:
    from tests.integration.web_server import serve

    app = pgcoord.web.app(dsn)
    with serve(app) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=pages + 5)) as client:
            opened = 0
            lock = threading.Lock()

            async def page() -> None:
                nonlocal opened
                async with client.stream("GET", "/events") as stream:
                    with lock:
                        opened += 1
                    async for _ in stream.aiter_lines():
                        pass

            tasks = [asyncio.create_task(page()) for _ in range(pages)]
            while opened < pages:
                await asyncio.sleep(0.05)
            sampler = app.state.pgcoord_dashboard.latest.sampler
            before = sampler.readings
            await asyncio.sleep(seconds)
            readings = sampler.readings - before
            listeners = sampler.listeners
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return readings, sampler.loops_started, listeners


async def main(args: argparse.Namespace) -> None:
    with bench_database({"max_connections": str(args.members * 2 + 60)}) as (dsn, _):
        holder = await populate(dsn, args.schedules, args.locks)
        members = []
        for i in range(args.members):
            m = pgcoord.Member(dsn, group=f"group-{i % 5}", name=f"member-{i}", meta={"zone": f"z{i % 3}"})
            await m.__aenter__()
            members.append(m)
        try:
            reader = Reader(dsn)
            sample, terms = await read_sample(reader, with_terms=None)
            assert sample.error is None, sample.error
            print(f"\nscale: {len(sample.schedules)} schedules, {len(sample.holders)} holder rows "
                  f"({sum(1 for h in sample.holders if h['granted'])} held), {len(sample.members)} members\n")
            one = await timed(lambda: reader.value("select 1"), args.rounds)
            status = await timed(lambda: reader.row("select count(*) from (" + query("holders_list") + ") s"),
                                 args.rounds)
            base = statistics.median(one)
            reading = await timed(lambda: read_sample(reader, with_terms=terms), args.rounds)
            kept = SchedulesKept()
            # The sampler's way: the schedules again only when their mark moved (or every 5 s).
            reading_kept = await timed(lambda: read_sample(reader, with_terms=terms, kept=kept),
                                       args.rounds)
            mark = await timed(lambda: reader.value(query("web_schedules_mark")), args.rounds)
            lean = await timed(lambda: reader.value(query("web_schedules")), args.rounds)
            fast = await timed(lambda: reader.value(query("web_sample")), args.rounds)

            def page(template: str, build: Callable[[], dict[str, Any]]) -> Callable[[], Awaitable[None]]:
                async def go() -> None:
                    render(template, layout="base.html", base="", path="/", pages=(), sample=sample,
                           data=build(), allowed=frozenset(), csrf="x", csrf_field="csrf", who="bench",
                           next_url="/")
                return go

            overview = await timed(page("overview.html", lambda: model.overview(sample)), args.rounds)
            elections = await timed(page("elections.html", lambda: model.elections(sample)), args.rounds)
            members_page = await timed(page("members.html", lambda: model.members(sample)), args.rounds)
            locks = await timed(page("locks.html", lambda: model.locks(sample)), args.rounds)

            app = pgcoord.web.app(dsn)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
                sampler = app.state.pgcoord_dashboard.sampler  # this loop's share
                sampler.interval = 3600.0  # one reading, then every GET is the render alone
                await client.get("/")
                whole = await timed(lambda: client.get("/"), args.rounds)
                api = await timed(lambda: client.get("/api/"), args.rounds)
                schedules = await timed(lambda: client.get("/schedules"), args.rounds)
                locks_get = await timed(lambda: client.get("/locks"), args.rounds)
            await pgcoord.web.aclose(app)
            await reader.aclose()

            print("| what                                           |  p50 ms  |  p95 ms  | vs SELECT 1 |")
            print("|------------------------------------------------|---------:|---------:|--------:|")
            print(row("baseline: SELECT 1 round trip", one, base))
            print(row("baseline: pgcoord status query (holders)", status, base))
            print(row("sampler: one reading, schedules read every time", reading, base))
            print(row("sampler: one reading, schedules when moved", reading_kept, base))
            print(row("  of which web_sample (holders, leases, members)", fast, base))
            print(row("  of which web_schedules (when read)", lean, base))
            print(row("  of which web_schedules_mark", mark, base))
            print(row("render: overview (model + template)", overview, base))
            print(row("render: elections", elections, base))
            print(row("render: members", members_page, base))
            print(row("render: locks (page 1 of 6)", locks, base))
            print(row("GET / through the ASGI app (sample cached)", whole, base))
            print(row("GET /api/ through the ASGI app", api, base))
            print(row("GET /locks through the ASGI app", locks_get, base))
            print(row("GET /schedules (page 1 of 100: reads its rows)", schedules, base))

            readings, loops, listeners = await fifty_pages(dsn, args.pages, args.seconds)
            print(f"\n{listeners} open pages (SSE) for {args.seconds:g} s: {readings} readings "
                  f"({readings / args.seconds:.2f}/s), {loops} sampler loop(s) started")
            print(f"schedules read {kept.reads} times in {args.rounds + 1} readings (kept)")
            quiet = statistics.median(fast) + statistics.median(mark)
            full = statistics.median(fast) + statistics.median(lean)
            print(f"database time of a reading (its statements' p50s): {full:.1f} ms with the schedules, "
                  f"{quiet:.1f} ms without them (mark only): {full / quiet:.1f}x less while they stand still")
            print(f"sampler cost: {statistics.median(reading_kept):.1f} ms per reading (was "
                  f"{statistics.median(reading):.1f}), mean {statistics.mean(reading_kept):.1f}; at most one a second "
                  f"= {statistics.median(reading_kept) / 10:.1f}% of one connection's time")
        finally:
            for m in members:
                await m.__aexit__(None, None, None)
            await holder.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--locks", type=int, default=1_000)
    parser.add_argument("--members", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pages", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(main(parser.parse_args()))
