"""A member whose session is lost but not yet replaced has no session to wait for.

Between the moment a member's session is found lost and the moment its loop has
stopped that session's tasks and dropped it, ``wait_joined()`` returned at once
while ``session()`` raised ``SessionLost``. A member lease's acquire loops on the
two, so it spun without ever yielding: the event loop froze, the member never got
to drop its session, and the process stopped answering for good. Found by the
Patroni switchover test (tests/ha_patroni): two of three replicas froze.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

import pgcoord
import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer

from .conftest import unique


@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


@pytest.mark.timeout(30)
async def test_a_member_lease_taken_as_the_member_loses_its_session_waits_for_the_new_one(
        own_server: EmbeddedServer) -> None:
    dsn = own_server.dsn
    pool = await asyncpg.create_pool(dsn, min_size=0, max_size=2)
    try:
        async with pgcoord.Member(dsn, group=unique("g"), ttl=10) as m:
            first = m.id
            beats = 0

            async def heartbeat() -> None:
                nonlocal beats
                while True:
                    beats += 1
                    await asyncio.sleep(0.01)

            ticker = asyncio.create_task(heartbeat())
            # The state the member is in when it has just found its session lost (a
            # driver's termination callback, a failed statement): lost, still joined.
            m._lost.set()
            lease = pgcoord.Lease(pool, unique("lease"), ttl=10, member=m)
            async with asyncio.timeout(10):
                fence = await lease.acquire(timeout=8)
            ticker.cancel()
            assert fence >= 1 and lease.valid
            assert m.id != first, "the lease was taken on the lost session"
            assert beats > 0
            await lease.release()
    finally:
        await pool.close()
