"""exclusive() never costs more round trips than the hand-written
``BEGIN; SELECT pg_advisory_xact_lock(k); COMMIT``, and costs one fewer: BEGIN
and the lock share a message. Counted on the wire, through a forwarding proxy,
for every source type, including what the pool does on checkout and return.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text

import pgcoord

from .proxy import FreezableProxy
from .sources import ASYNC_CONNS, ASYNC_POOLS, SYNC_CONNS, SYNC_POOLS, open_async, open_sync

KEY = 424_242
OPS = 5
WARM_UP = 6


@pytest.fixture
def proxy(dsn: str) -> Iterator[FreezableProxy]:
    counter = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]))
    try:
        yield counter
    finally:
        counter.close()


def _hand_async(kind: str, source: Any) -> Callable[[], Awaitable[None]]:
    """The transaction a user of that driver would write by hand."""
    if kind.startswith("asyncpg"):
        async def by_hand() -> None:
            if kind == "asyncpg-pool":
                async with source.acquire() as conn, conn.transaction():
                    await conn.execute("select pg_advisory_xact_lock($1)", KEY)
            else:
                async with source.transaction():
                    await source.execute("select pg_advisory_xact_lock($1)", KEY)
    elif kind.startswith("psycopg"):
        async def by_hand() -> None:
            if kind == "psycopg-pool":
                async with source.connection() as conn, conn.transaction():
                    await conn.execute("select pg_advisory_xact_lock(%s)", (KEY,))
            else:
                async with source.transaction():
                    await source.execute("select pg_advisory_xact_lock(%s)", (KEY,))
    else:
        async def by_hand() -> None:
            if kind == "sa-async-conn":
                async with source.begin():
                    await source.execute(text("select pg_advisory_xact_lock(:k)"), {"k": KEY})
            else:
                async with source.begin() as conn:
                    await conn.execute(text("select pg_advisory_xact_lock(:k)"), {"k": KEY})
    return by_hand


def _hand_sync(kind: str, source: Any) -> Callable[[], None]:
    if kind.startswith("psycopg"):
        def by_hand() -> None:
            if kind == "psycopg-sync-pool":
                with source.connection() as conn, conn.transaction():
                    conn.execute("select pg_advisory_xact_lock(%s)", (KEY,))
            else:
                with source.transaction():
                    source.execute("select pg_advisory_xact_lock(%s)", (KEY,))
    else:
        def by_hand() -> None:
            if kind == "sa-sync-conn":
                with source.begin():
                    source.execute(text("select pg_advisory_xact_lock(:k)"), {"k": KEY})
            else:
                with source.begin() as conn:
                    conn.execute(text("select pg_advisory_xact_lock(:k)"), {"k": KEY})
    return by_hand


@pytest.mark.parametrize("kind", ASYNC_POOLS + ASYNC_CONNS)
async def test_async_sources_take_one_round_trip_fewer(
    kind: str, dsn: str, proxy: FreezableProxy,
) -> None:
    async with open_async(kind, proxy.dsn(dsn), size=1) as source:
        by_hand = _hand_async(kind, source)

        async def ours() -> None:
            async with pgcoord.exclusive(source, KEY):
                pass

        async def count(op: Callable[[], Awaitable[None]]) -> int:
            # Connect, let SQLAlchemy inspect the server, and get past psycopg's
            # prepare threshold (5): those are one-off round trips.
            for _ in range(WARM_UP):
                await op()
            before = proxy.round_trips
            for _ in range(OPS):
                await op()
            return proxy.round_trips - before

        hand, mine = await count(by_hand), await count(ours)
    assert mine == hand - OPS, f"pgcoord {mine} round trips, hand-written {hand}, for {OPS} locks"


@pytest.mark.parametrize("kind", SYNC_POOLS + SYNC_CONNS)
def test_sync_sources_take_one_round_trip_fewer(kind: str, dsn: str, proxy: FreezableProxy) -> None:
    with open_sync(kind, proxy.dsn(dsn), size=1) as source:
        by_hand = _hand_sync(kind, source)

        def ours() -> None:
            with pgcoord.exclusive(source, KEY):
                pass

        def count(op: Callable[[], None]) -> int:
            for _ in range(WARM_UP):  # as above
                op()
            before = proxy.round_trips
            for _ in range(OPS):
                op()
            return proxy.round_trips - before

        hand, mine = count(by_hand), count(ours)
    assert mine == hand - OPS, f"pgcoord {mine} round trips, hand-written {hand}, for {OPS} locks"


@pytest.mark.parametrize("autocommit", [False, True])
def test_a_connection_in_pipeline_mode_takes_two_round_trips_per_lock(
    dsn: str, proxy: FreezableProxy, autocommit: bool,
) -> None:
    """One Sync for BEGIN and the lock's statements together, one for COMMIT; the
    caller's pipeline is read out first only when something in it is unanswered.
    Without autocommit, two more: psycopg syncs its pipeline to switch autocommit
    on and back, which pgcoord does so that a body that ends the transaction
    itself is told so (as outside pipeline mode)."""
    import psycopg

    with psycopg.connect(proxy.dsn(dsn), autocommit=autocommit) as conn, conn.pipeline():
        for _ in range(WARM_UP):
            with pgcoord.exclusive(conn, KEY):
                pass
        before = proxy.round_trips
        for _ in range(OPS):
            with pgcoord.exclusive(conn, KEY):
                pass
        mine = proxy.round_trips - before
    assert mine == (2 if autocommit else 4) * OPS, f"{mine} round trips for {OPS} locks"
