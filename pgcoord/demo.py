"""``pgcoord demo``: pgcoord working for real, on a throwaway server by default."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from . import migrations
from ._embedded import EmbeddedServer
from .status import fetch_holders, format_table


def _step(n: int, text: str) -> None:
    print(f"[{n}] {text}", flush=True)


@contextlib.contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    _step(0, "starting a throwaway PostgreSQL (binaries found on this machine)")
    with EmbeddedServer() as server:
        print(f"    {server.dsn}  (v{server.bindir.parent.name}, data in a temp dir)")
        yield server.dsn


async def _contend(dsn: str) -> None:
    import psycopg_pool

    import pgcoord

    async with psycopg_pool.AsyncConnectionPool(
        dsn, min_size=2, max_size=3, open=False,
        kwargs={"application_name": "pgcoord-demo"},
    ) as pool:
        order: list[str] = []
        first_holds = asyncio.Event()

        async def worker(name: str, hold: float) -> None:
            started = time.monotonic()
            async with pgcoord.exclusive(pool, "demo:nightly-invoices") as conn:
                waited = time.monotonic() - started
                order.append(name)
                print(f"    {name} holds the lock (waited {waited * 1000:.0f} ms), pid "
                      f"{conn.info.backend_pid}", flush=True)
                first_holds.set()
                await asyncio.sleep(hold)

        first = asyncio.create_task(worker("task A", 1.0))
        await first_holds.wait()
        second = asyncio.create_task(worker("task B", 0.0))
        await asyncio.sleep(0.3)
        print("    pgcoord.holders while A holds and B waits:")
        table = await asyncio.to_thread(fetch_holders, dsn)
        print("      " + format_table(table).replace("\n", "\n      "))
        await asyncio.gather(first, second)
        assert order == ["task A", "task B"], order


def run_demo(dsn: str | None) -> int:
    started = time.monotonic()
    with _database(dsn) as url:
        _step(1, "installing pgcoord's schema (pgcoord migrate)")
        migrations.upgrade(url)
        print(f"    schema at revision {migrations.current(url)}")
        _step(2, "two tasks contend for exclusive(pool, 'demo:nightly-invoices')")
        asyncio.run(_contend(url))
        _step(3, "after release, pgcoord.holders is empty:")
        print("      " + format_table(fetch_holders(url)).replace("\n", "\n      "))
        if dsn is None:
            _step(4, "stopping and removing the throwaway server")
    print(f"done in {time.monotonic() - started:.1f}s")
    return 0
