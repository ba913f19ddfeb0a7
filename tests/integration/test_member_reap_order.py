"""Reapers that mark the same dead members at once lock them in the same order, by id
(migration 0012).

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

import pgcoord

from .conftest import migrated_database, sql


@pytest.fixture
def own_db(pg_server: object) -> Iterator[str]:
    yield from migrated_database(pg_server, "pgcoord_reap_order")  # type: ignore[arg-type]


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


async def test_two_reapers_whose_plans_cross_lock_in_one_order(own_db: str) -> None:
    dsn = own_db
    group = f"order-{uuid.uuid4().hex[:6]}"
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
        await blocked_by(look, by_heap.get_server_pid())
        reap_index = asyncio.create_task(by_index.fetchval("SELECT pgcoord.member_reap_dead()"))
        await blocked_by(look, by_index.get_server_pid())
        # In the plans' own orders: a is let go, and the index reaper marks it, then
        # queues for b behind the heap reaper; b is let go, and the heap reaper marks b
        # and wants a, which the index reaper holds: a deadlock.
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


def left_reason(dsn: str, member_id: int) -> object:
    rows = sql(dsn, "SELECT left_reason FROM pgcoord.member_sessions WHERE id = %s", member_id)
    return rows[0][0] if rows else "missing"


async def test_a_goodbye_does_not_wait_for_a_reaper_stuck_on_another_row(own_db: str) -> None:
    """A reaper waits for a dead row an operator's transaction holds. A member of
    another group that says goodbye meanwhile is told as ``left`` at once: a goodbye
    marks its own row and waits for no reaper (a lock that made reapers take turns,
    tried first, held every goodbye and join of the database behind the stuck one)."""
    dsn = own_db
    g1, g2 = f"stuck-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    async with pgcoord.Member(dsn, group=g1, name="a1", ttl=30), \
            pgcoord.Member(dsn, group=g2, name="b1", ttl=30) as b1:
        x = pgcoord.Member(dsn, group=g1, name="x", ttl=30)
        b2 = pgcoord.Member(dsn, group=g2, name="b2", ttl=30)
        await x.open()
        await b2.open()
        watch = b1.watch()
        await asyncio.sleep(0.3)
        op = await asyncpg.connect(dsn)
        try:
            tx = op.transaction()
            await tx.start()
            await op.execute("UPDATE pgcoord.member_sessions SET meta = meta WHERE id = $1", x.id)
            assert x._main is not None
            sql(dsn, "SELECT pg_terminate_backend(%s)", x._main.backend_pid)
            deadline = time.monotonic() + 5
            while not sql(dsn, "SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted"):
                assert time.monotonic() < deadline, "no reaper waits for x's row"
                await asyncio.sleep(0.01)
            b2_id, started = b2.id, time.monotonic()
            await b2.close()
            change = await asyncio.wait_for(watch.__anext__(), 5)
            told_after = time.monotonic() - started
        finally:
            await tx.rollback()
            await op.close()
            await x.close()
    assert isinstance(change, pgcoord.MemberLeft) and change.member.id == b2_id
    assert (change.reason, left_reason(dsn, b2_id)) == ("left", "left")
    assert told_after < 2.0, told_after


async def test_a_sessionless_member_s_beat_survives_its_sweep_crossing_a_sweeper(own_db: str) -> None:
    """A member behind a pooler (no session) sweeps at every beat. Its beat locks its
    own row, then its sweep waits for a dead row another sweeper holds, while that
    sweeper (which judged the member dead: its heartbeat had just run out) waits for
    the member's row. The server breaks the deadlock; the beat must stand, with only
    its sweep undone (before 0012 the whole beat was rolled back)."""
    dsn = own_db
    g = f"poll-{uuid.uuid4().hex[:6]}"
    conns = []
    try:
        # dead first: the sweeper, in id order, waits for it before it comes to p.
        for name, session, ttl_ms in (("dead", True, 30000), ("p", False, 500)):
            conns.append(conn := await asyncpg.connect(dsn))
            await conn.fetchval(
                "SELECT id FROM pgcoord.member_join_from($1, $2, '{}'::jsonb, $3, 'test', $4, $5)",
                g, name, ttl_ms, session, "test-host:1")
    finally:
        for conn in conns:
            await conn.close()
    p_id, dead_id = (r[0] for r in sql(
        dsn, 'SELECT id FROM pgcoord.member_sessions WHERE "group" = %s ORDER BY name DESC', g))
    await asyncio.sleep(0.7)  # p's heartbeat runs out
    look, hold, sweeper, p = [await asyncpg.connect(dsn) for _ in range(4)]
    try:
        for conn in (hold, sweeper, p):
            await conn.execute("SET lock_timeout = 0; SET statement_timeout = 0")
        # The server breaks the deadlock on p's side: the sweep of its beat is undone.
        await sweeper.execute("SET deadlock_timeout = '10s'")
        await p.execute("SET deadlock_timeout = '200ms'")
        tx = hold.transaction()
        await tx.start()
        await hold.execute("SELECT 1 FROM pgcoord.member_sessions WHERE id = $1 FOR UPDATE", dead_id)
        sweep = asyncio.create_task(sweeper.fetchval("SELECT pgcoord.member_reap_group($1)", g))
        await blocked_by(look, sweeper.get_server_pid())  # on the dead row
        beat = asyncio.create_task(p.fetchval("SELECT pgcoord.member_beat($1, false)", p_id))
        await blocked_by(look, p.get_server_pid())  # p's row locked, its sweep waits too
        await tx.commit()
        results = await asyncio.wait_for(asyncio.gather(sweep, beat, return_exceptions=True), 15)
    finally:
        for conn in (look, hold, sweeper, p):
            await conn.close()
    assert [r for r in results if isinstance(r, BaseException)] == [], results
    assert results == [1, "{}"]  # the beat stood; the sweep marked only the dead member
    assert left_reason(dsn, p_id) is None and left_reason(dsn, dead_id) == "crashed"


async def test_a_sweeping_beat_gives_up_its_sweep_on_a_held_row_and_stands(own_db: str) -> None:
    """An operator's transaction holds a dead member's row. The group's sweeper beats:
    its sweep gives up after its own bound (100 ms), whatever the session's
    lock_timeout (none here), and the beat itself is written. Before 0012 the beat
    waited as long as the session let it, and then was rolled back whole."""
    dsn = own_db
    g = f"held-{uuid.uuid4().hex[:6]}"
    beater = await asyncpg.connect(dsn)
    op = await asyncpg.connect(dsn)
    try:
        await beater.execute("SET lock_timeout = 0; SET statement_timeout = 0")
        # The sweeper first: the group's lowest id, it sweeps at every beat.
        own = await beater.fetchval(
            "SELECT id FROM pgcoord.member_join_from($1, 'sweeper', '{}'::jsonb, 30000, 'test', true, $2)",
            g, "test-host:2")
        ids = await dead_members(dsn, g, ["dead"])
        tx = op.transaction()
        await tx.start()
        await op.execute("SELECT 1 FROM pgcoord.member_sessions WHERE id = $1 FOR UPDATE", ids["dead"])
        before = await beater.fetchval("SELECT heartbeat_at FROM pgcoord.member_sessions WHERE id = $1", own)
        started = time.monotonic()
        state = await asyncio.wait_for(beater.fetchval("SELECT pgcoord.member_beat($1, false)", own), 5)
        took = time.monotonic() - started
        after = await beater.fetchval("SELECT heartbeat_at FROM pgcoord.member_sessions WHERE id = $1", own)
        await tx.rollback()
        assert await beater.fetchval("SHOW lock_timeout") == "0"  # put back as it was
        swept = await beater.fetchval("SELECT pgcoord.member_beat($1, false)", own)
    finally:
        await op.close()
        await beater.close()
    assert state == "{}" and after > before, (state, before, after)
    assert took < 2.0, took
    assert swept == "{}" and left_reason(dsn, ids["dead"]) == "crashed"  # the next beat sweeps it
