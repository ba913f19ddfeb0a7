"""One member process for the membership fault tests.

    python member_replica.py DSN GROUP NAME TTL DRIVER

Joins, prints ``JOINED <id>``, then one line per change it sees:
``LEFT <name> <reason> <unix time>`` or ``JOINED-PEER <name> <unix time>``. On
SIGTERM it leaves gracefully.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import pgcoord


async def main(dsn: str, group: str, name: str, ttl: float, driver: str) -> None:
    member = pgcoord.Member(dsn, group=group, name=name, ttl=ttl, driver=driver)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with member:
        print(f"JOINED {member.id}", flush=True)

        async def report() -> None:
            async for change in member.watch():
                if isinstance(change, pgcoord.MemberLeft):
                    print(f"LEFT {change.member.name} {change.reason} {time.time():.6f}", flush=True)
                else:
                    print(f"JOINED-PEER {change.member.name} {time.time():.6f}", flush=True)

        reporter = asyncio.create_task(report())
        await stop.wait()
        reporter.cancel()
    print("STOPPED", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
