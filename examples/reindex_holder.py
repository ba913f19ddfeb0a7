"""A long reindex under a session lock: no transaction is held open while it runs.

    python examples/reindex_holder.py postgresql://user@host/db

If the session holding the lock dies (the backend is terminated, the server restarts, the
network goes silent) the reindex is cancelled and LockLost is raised, so it never goes on
believing it holds the lock.
"""

import asyncio
import sys

import pgcoord


async def reindex(step: int) -> None:
    await asyncio.sleep(0.2)  # stand-in for one chunk of real work
    print(f"reindexed chunk {step}")


async def main(dsn: str) -> None:
    async with pgcoord.LockHolder(dsn, application_name="example-reindexer") as holder:
        try:
            async with holder.lock("example:reindex", timeout=30):
                for step in range(1, 4):
                    await reindex(step)
        except pgcoord.LockTimeout:
            print("another reindex has held the lock for 30 s; giving up")
        except pgcoord.LockLost as lost:
            print(f"stopped: {lost}")
    print("done; the lock is released and the connection closed")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
