"""Run by test_exclusive_hostile.py in a process of its own: cancel a psycopg
statement of pgcoord's while the network is silent, and say how long the
cancellation took. In a process of its own because the failure being tested
(psycopg < 3.2's blocking cancel request) stops the event loop for good, and
with it anything that could report or time out.

    python -m tests.integration.cancel_on_silent_network DSN KEY exclusive|statement

Prints "waiting" once the statement is under way, waits for a line on stdin
(the test freezes the network), cancels, prints "cancelled <seconds>".
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import psycopg_pool

import pgcoord
from pgcoord._drivers import run_statement


async def main(dsn: str, key: str, what: str) -> None:
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:
        async def work() -> None:
            if what == "exclusive":
                async with pgcoord.exclusive(pool, key):
                    pass
            else:
                await run_statement(pool, "select pg_sleep(60)", ())

        task = asyncio.create_task(work())
        await asyncio.sleep(1.0)
        print("waiting", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        started = time.monotonic()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        print(f"cancelled {time.monotonic() - started:.3f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
