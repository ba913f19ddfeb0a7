"""How LockHolder releases: unlocks that ride with the next statement, and what
that promises (issue 11, "LockHolder speed")."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

import pgcoord

from .conftest import advisory_locks
from .proxy import FreezableProxy


def held_by(dsn: str, pid: int | None) -> list[int]:
    return sorted(key for p, key, granted in advisory_locks(dsn) if p == pid and granted)


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_unlock_shares_a_round_trip_with_the_next_lock(dsn: str, driver: str) -> None:
    proxy = FreezableProxy("127.0.0.1", int(dsn.rsplit(":", 1)[1].split("/")[0]))
    try:
        async with pgcoord.LockHolder(proxy.dsn(dsn), driver=driver, keepalive=30) as holder:
            # The warm-up takes the key's first-use cost (its name recorded, once
            # per key and process) out of the count.
            async with holder.lock("unlocks:loop"):
                pass
            await holder.flush()
            before = proxy.round_trips
            for _ in range(50):
                async with holder.lock("unlocks:loop"):
                    pass
            await holder.flush()
            # 50 locks and 50 unlocks; written by hand, 100 round trips.
            assert proxy.round_trips - before <= 52
    finally:
        proxy.close()
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_session_waiting_in_the_server_gets_the_lock_once_it_is_left(
    dsn: str, driver: str,
) -> None:
    key = pgcoord.lock_key("unlocks:handoff")
    other = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn, driver=driver) as holder:
            async with holder.lock(key):
                waiter = asyncio.create_task(other.execute(f"select pg_advisory_lock({key})"))
                await asyncio.sleep(0.1)
                assert not waiter.done()
                left = time.monotonic()
            # Nothing else happens on the holder: the unlock goes out on its own.
            await asyncio.wait_for(waiter, 5)
            assert time.monotonic() - left < 1
            # And our next try comes after it: the waiter has the lock now.
            with pytest.raises(pgcoord.LockBusy):
                async with holder.lock(key, wait=False):
                    pass
            await other.execute(f"select pg_advisory_unlock({key})")
    finally:
        await other.close()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_session_waiting_in_the_server_goes_before_our_own_next_try(
    dsn: str, driver: str,
) -> None:
    key = pgcoord.lock_key("unlocks:fair")
    other = await asyncpg.connect(dsn)
    try:
        async with pgcoord.LockHolder(dsn, driver=driver) as holder:
            async with holder.lock(key):
                waiter = asyncio.create_task(other.execute(f"select pg_advisory_lock({key})"))
                await asyncio.sleep(0.1)
            # At once, in the same step: the unlock and this try share one
            # statement, and the unlock runs first, so the waiter is served first.
            with pytest.raises(pgcoord.LockBusy):
                async with holder.lock(key, wait=False):
                    pass
            await asyncio.wait_for(waiter, 5)
            await other.execute(f"select pg_advisory_unlock({key})")
    finally:
        await other.close()
    assert advisory_locks(dsn) == []


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_flush_and_defer_unlocks_false_release_before_going_on(dsn: str, driver: str) -> None:
    key = pgcoord.lock_key("unlocks:strict")
    async with pgcoord.LockHolder(dsn, driver=driver) as holder:
        async with holder.lock(key):
            pass
        await holder.flush()
        assert held_by(dsn, holder.backend_pid) == []  # a blocking look, right away
    async with pgcoord.LockHolder(dsn, driver=driver, defer_unlocks=False) as holder:
        for _ in range(3):
            async with holder.lock(key):
                assert held_by(dsn, holder.backend_pid) == [key]
            assert held_by(dsn, holder.backend_pid) == []


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_unlock_that_finds_nothing_held_ends_the_session(dsn: str, driver: str) -> None:
    async with pgcoord.LockHolder(dsn, driver=driver, keepalive=30) as holder:
        pid = holder.backend_pid
        with pytest.raises(pgcoord.LockLost, match="found no lock held"):
            async with holder.lock("unlocks:b"):
                async with holder.lock("unlocks:a"):
                    main = holder._main
                    assert main is not None
                    async with main._io:  # behind the holder's back
                        await main.conn.fetchval("select pg_advisory_unlock_all()")
                # Leaving "a" finds it not held: the holder cannot trust this
                # session any more, and "b", held on it, is lost.
                await asyncio.sleep(5)
        async with holder.lock("unlocks:b", wait=False):
            assert holder.backend_pid != pid
    assert advisory_locks(dsn) == []
