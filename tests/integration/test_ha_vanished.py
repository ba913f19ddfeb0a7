"""A failover where the old primary's host vanishes instead of its process ending.

In test_ha.py every client hears of the failover at once: the dying server closes
its sockets. When the host itself is lost (power, network), the leader's session
is half-open: nothing arrives, nothing is refused. Followers that reconnect find
the lease row on the new primary naming a session that server never had (before
migration 0007 they took over at once). The old leader must stop believing by its
own clock, within its trust window, less than one ttl after its last renewal, and
only then may the lease, expired, be taken over; its fenced writes are refused. Here the leader reaches the
primary through a proxy that goes silent just before the primary is killed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import psycopg
import pytest

import pgcoord
import pgcoord.migrations

from .ha import StandbyPair
from .proxy import FreezableProxy

TTL = 2.0


async def test_a_leader_cut_off_from_a_vanished_primary_stops_believing_within_its_ttl() -> None:
    with StandbyPair(synchronous=True) as pair:
        pgcoord.migrations.upgrade(pair.url())
        proxy = FreezableProxy("127.0.0.1", pair.primary.port)
        cut_off = (f"postgresql://postgres@127.0.0.1:{proxy.port},127.0.0.1:{pair.standby.port}"
                   f"/postgres?target_session_attrs=read-write")
        events: list[tuple[float, str, str, int]] = []  # (monotonic time, who, what, fence)
        changed = asyncio.Event()

        def leader(who: str) -> Callable[[int], Awaitable[None]]:
            async def lead(fence: int) -> None:
                events.append((time.monotonic(), who, "lead", fence))
                changed.set()
                try:
                    await asyncio.Event().wait()
                finally:
                    events.append((time.monotonic(), who, "stop", fence))
                    changed.set()
            return lead

        def first(what: str, *, fence_above: int = 0, who: str | None = None) -> tuple[float, int] | None:
            return next(((at, f) for at, w, ev, f in events
                         if ev == what and f > fence_above and who in (None, w)), None)

        async def until(done: Callable[[], bool]) -> None:
            async with asyncio.timeout(TTL + 10):
                while not done():
                    changed.clear()
                    await changed.wait()

        old = pgcoord.Elector(cut_off, "vanished", ttl=TTL, holder="old")
        new = pgcoord.Elector(pair.url(), "vanished", ttl=TTL, holder="new")
        tasks = [asyncio.create_task(old.run(leader("old")))]
        try:
            await until(lambda: first("lead") is not None)
            tasks.append(asyncio.create_task(new.run(leader("new"))))
            await asyncio.sleep(TTL / 2)  # a renewal or two; the follower waits on the doorbell
            proxy.freeze()  # the primary's host is gone, as far as the leader can tell
            killed = time.monotonic()
            await asyncio.to_thread(pair.fail_over)
            await until(lambda: first("stop", who="old") is not None
                        and first("lead", fence_above=1) is not None)
            await _old_fence_is_rejected(cut_off, first("stop", who="old")[1])  # type: ignore[index]
        finally:
            proxy.close()
            for elector in (new, old):
                await elector.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
    stopped, old_fence = first("stop", who="old")  # type: ignore[misc]
    took_over, _ = first("lead", fence_above=old_fence)  # type: ignore[misc]
    # The old leader stops by its own clock, within its trust window, and only then
    # is the lease taken over (by the follower, or by the old process itself once it
    # reaches the new primary): never two leaders, though the new server cannot see
    # the old session to know it is gone (migration 0007: the lease expires first).
    assert took_over > stopped, f"two leaders for {stopped - took_over:.3f}s"
    # Generous bounds (a loaded machine): the trust window closes within 0.9 ttl of the
    # last renewal, the lease expires one ttl after it, then a reconnect and a retry.
    assert stopped - killed < TTL + 1.0, f"the old leader believed {stopped - killed:.2f}s after"
    assert took_over - killed < TTL + 3.0


async def _old_fence_is_rejected(cut_off: str, old_fence: int) -> None:
    """The cut-off leader, reconnecting through its own DSN (its first host still
    frozen), reaches the new primary, where its fenced write is refused."""
    async with asyncio.timeout(15):
        conn = await psycopg.AsyncConnection.connect(cut_off, autocommit=True, connect_timeout=3)
    try:
        with pytest.raises(pgcoord.StaleFence):
            async with conn.transaction():
                await pgcoord.check_fence(conn, "vanished", old_fence)
                await conn.execute("select 1")  # the write it would have made
    finally:
        await conn.close()
