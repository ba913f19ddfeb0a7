"""One process with a Member and N electors on it, for failover tests and benches.

    python elector_member_replica.py DSN PREFIX N LABEL

Elector i campaigns for lease ``PREFIX:i`` (ttl 30 s). Prints ``LEAD <i> <unix time>``
when it starts to lead lease i.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pgcoord


async def main(dsn: str, prefix: str, n: int, label: str) -> None:
    async with pgcoord.Member(dsn, group=f"{prefix}:group", name=label, ttl=30) as member:

        def lead_for(i: int) -> object:
            async def lead(fence: int) -> None:
                print(f"LEAD {i} {time.time():.6f} {fence}", flush=True)
                await asyncio.sleep(3600)
            return lead

        electors = [pgcoord.Elector(member, f"{prefix}:{i}", ttl=30) for i in range(n)]
        await asyncio.gather(*(e.run(lead_for(i)) for i, e in enumerate(electors)))  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
