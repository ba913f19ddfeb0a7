"""Sessionless members (behind a transaction-mode pgbouncer) in one group with
different ttls: a death is told within its ttl, and told silent."""
from __future__ import annotations

import asyncio
import time
import uuid

import pgcoord

from .test_member import next_change


import pytest


@pytest.mark.parametrize("slow_ttl", [30.0, 1.5])
async def test_a_sessionless_death_is_told_within_its_ttl_beside_a_long_ttl_member(dsn: str, slow_ttl: float) -> None:
    from .pgbouncer import PgBouncer

    driver = "psycopg"
    bouncer = PgBouncer(int(dsn.rsplit(":", 1)[1].split("/")[0]))
    pooled = bouncer.dsn(dsn)
    g = f"sweep-{uuid.uuid4().hex[:6]}"
    ttl = 1.5
    try:
        # Lowest id: a member with a long ttl (a batch process, say): fresh for 15 s.
        async with pgcoord.Member(pooled, group=g, name="slow", ttl=slow_ttl, driver=driver) as slow, \
                pgcoord.Member(pooled, group=g, name="a", ttl=ttl, driver=driver) as a:
            assert slow.polling is True and slow.id < a.id  # type: ignore[operator]
            changes = a.watch()
            c = pgcoord.Member(pooled, group=g, name="c", ttl=ttl, driver=driver)
            await c.open()
            assert isinstance(await next_change(changes, timeout=ttl * 2), pgcoord.MemberJoined)
            assert c._runner is not None
            c._runner.cancel()
            await c._stop_tasks()
            started = time.monotonic()
            try:
                left = await next_change(changes, timeout=15)
                took = time.monotonic() - started
                assert isinstance(left, pgcoord.MemberLeft) and left.member.name == "c"
                # the same bound as test_behind_a_transaction_mode_pooler_membership_polls_heartbeat_rows
                assert took < ttl + ttl / 3 + 1.0, (took, left.reason)
                # a pooler hides how it ended: told silent (as that test asserts)
                assert left.reason == "silent", (took, left.reason)
            finally:
                await c._drop_sessions()
    finally:
        bouncer.stop()
