"""One process leading with an Elector, async or sync (the same test runs both).

    python sync_elector_replica.py DSN NAME TTL [async|sync]

Prints ``LEAD <fence> <unix time>`` when a term starts and ``END <fence>`` when its
lead() ends (the sync one returns once told its term is lost; the async one is
cancelled).
"""

from __future__ import annotations

import asyncio
import sys
import time

import pgcoord
import pgcoord.sync


def run_sync(dsn: str, name: str, ttl: float) -> None:
    elector = pgcoord.sync.Elector(dsn, name, ttl=ttl)

    def lead(term: pgcoord.sync.Term) -> None:
        print(f"LEAD {term.fence} {time.time():.6f}", flush=True)
        while not term.wait(0.05):
            pass
        print(f"END {term.fence}", flush=True)

    elector.run(lead)


async def run_async(dsn: str, name: str, ttl: float) -> None:
    elector = pgcoord.Elector(dsn, name, ttl=ttl)

    async def lead(fence: int) -> None:
        print(f"LEAD {fence} {time.time():.6f}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            print(f"END {fence}", flush=True)

    await elector.run(lead)


if __name__ == "__main__":
    mode = sys.argv[4] if len(sys.argv) > 4 else "sync"
    if mode == "sync":
        run_sync(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    else:
        asyncio.run(run_async(sys.argv[1], sys.argv[2], float(sys.argv[3])))
