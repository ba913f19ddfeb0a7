"""Reapers that mark the same dead members at once take turns (migration 0012).

Found by the crash-news benchmark: when a process took ten members with it, two or
three watchers were granted at once, and each reaped. Each marked the dead rows in
the order of its own plan (a sequential scan in heap order, an index scan by name or
id). Crossed orders deadlocked, the server found it only after ``deadlock_timeout``
(1 s), and every survivor heard of the crash 1 to 2 s late instead of in tens of
milliseconds. These tests cross the orders on purpose, with real sessions.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator

import asyncpg
import pytest

from .conftest import migrated_database, sql


@pytest.fixture
def own_db(pg_server: object) -> Iterator[str]:
    yield from migrated_database(pg_server, "pgcoord_reap_turns")  # type: ignore[arg-type]


async def dead_members(dsn: str, group: str, names: list[str]) -> dict[str, int]:
    """Members that joined as pgcoord joins, on sessions that then ended: rows that
    look alive, whose alive locks nobody holds, and whom no watcher waits for."""
    ids, sessions = {}, []
    try:
        for name in names:  # all joined before any session ends: a join reaps the dead
            sessions.append(conn := await asyncpg.connect(dsn))
            ids[name] = await conn.fetchval(
                "SELECT id FROM pgcoord.member_join_from($1, $2, '{}'::jsonb, 30000, 'test', true, $3)",
                group, name, "test-host:1")
    finally:
        for conn in sessions:
            await conn.close()
    return ids


async def blocked_by(conn: asyncpg.Connection, pid: int) -> list[int]:
    """The sessions ``pid`` waits for, once it waits for any (within 5 s)."""
    deadline = time.monotonic() + 5
    while True:
        blockers = await conn.fetchval("SELECT pg_catalog.pg_blocking_pids($1)", pid)
        if blockers:
            return list(blockers)
        assert time.monotonic() < deadline, f"session {pid} never waited"
        await asyncio.sleep(0.01)


async def test_two_reapers_scanning_in_crossed_orders_take_turns(own_db: str) -> None:
    dsn = own_db
    group = f"turns-{uuid.uuid4().hex[:6]}"
    ids = await dead_members(dsn, group, ["a", "b"])
    # A new version of a's row goes behind b's: a sequential scan meets b first, while
    # an index scan (by name, or by id) meets a first.
    sql(dsn, "UPDATE pgcoord.member_sessions SET ttl_ms = ttl_ms WHERE id = %s", ids["a"])
    heap = [r[0] for r in sql(
        dsn, 'SELECT id FROM pgcoord.member_sessions WHERE "group" = %s ORDER BY ctid', group)]
    assert heap == [ids["b"], ids["a"]]

    look = await asyncpg.connect(dsn)
    hold_a, hold_b = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    by_heap, by_index = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        for conn in (hold_a, hold_b, by_heap, by_index):  # the test orders the waits itself
            await conn.execute("SET lock_timeout = 0; SET statement_timeout = 0")
        await by_heap.execute("SET enable_indexscan = off; SET enable_bitmapscan = off; "
                              "SET enable_indexonlyscan = off")
        await by_index.execute("SET enable_seqscan = off; SET enable_bitmapscan = off")
        # Two sessions hold a's and b's rows, so that each reaper's first step waits.
        holds = []
        for conn, name in ((hold_a, "a"), (hold_b, "b")):
            tx = conn.transaction()
            await tx.start()
            await conn.execute("SELECT 1 FROM pgcoord.member_sessions WHERE id = $1 FOR UPDATE", ids[name])
            holds.append(tx)
        reap_heap = asyncio.create_task(by_heap.fetchval("SELECT pgcoord.member_reap_dead()"))
        await blocked_by(look, by_heap.get_server_pid())  # on b
        reap_index = asyncio.create_task(by_index.fetchval("SELECT pgcoord.member_reap_dead()"))
        await blocked_by(look, by_index.get_server_pid())  # on a (or on its turn)
        # a is let go: the index reaper marks it, then queues for b behind the heap
        # reaper; b is let go: the heap reaper marks b and wants a, which the index
        # reaper holds. Without turns, that is a deadlock.
        await holds[0].commit()
        deadline = time.monotonic() + 5
        while hold_a.get_server_pid() in await blocked_by(look, by_index.get_server_pid()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await holds[1].commit()
        results = await asyncio.wait_for(asyncio.gather(reap_heap, reap_index, return_exceptions=True), 10)
    finally:
        for conn in (look, hold_a, hold_b, by_heap, by_index):
            await conn.close()

    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors == [], errors
    told = sorted(member_id for raw in results for member_id, _ in json.loads(str(raw)))
    assert told == sorted(ids.values())  # each death marked once, by one of them
    rows = sql(dsn, 'SELECT left_reason FROM pgcoord.member_sessions WHERE "group" = %s', group)
    assert sorted(r[0] for r in rows) == ["crashed", "crashed"]
