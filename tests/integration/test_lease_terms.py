"""The history of leadership (migration 0009, pgcoord.lease_terms): every way a term
ends is recorded, with the right ``ended_how`` and times, by whichever path changed
the lease row; the record stays bounded; the migration goes down and up again."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.migrations
import pgcoord.testing
from pgcoord._core.resources import read_sql

from .conftest import Server, advisory_locks, sql, unique

# A child that leads `name` on its own session (an Elector(dsn)) or on a Member's,
# prints LEAD <fence> and <pid of the session holding the lease>, then waits to die.
CHILD = r"""
import asyncio, sys
import pgcoord

async def main(dsn, name, label, on_member):
    async def lead(fence):
        print("LEAD", fence, flush=True)
        await asyncio.Event().wait()
    if on_member == "member":
        async with pgcoord.Member(dsn, group="terms", name=label) as member:
            await pgcoord.Elector(member, name, ttl=30.0, holder=label).run(lead)
    else:
        await pgcoord.Elector(dsn, name, ttl=30.0, holder=label).run(lead)

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture
async def pool(dsn: str) -> asyncpg.Pool:
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    yield p
    await p.close()


def terms(dsn: str, name: str) -> list[tuple[object, ...]]:
    return sql(dsn, "select fence, holder, holder_pid, started_at, ended_at, ended_how,"
                    " resign_requested_at from pgcoord.lease_terms where name = %s order by fence",
               name)


def db_now(dsn: str) -> dt.datetime:
    now = sql(dsn, "select clock_timestamp()")[0][0]
    assert isinstance(now, dt.datetime)
    return now


async def wait_for(check, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def spawn_leader(procs: list[subprocess.Popen[str]], dsn: str, name: str, label: str,
                 on_member: bool) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, dsn, name, label, "member" if on_member else "own"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    procs.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("LEAD"), line
    return proc, int(line.split()[1])


# -- each way a term ends -----------------------------------------------------------------


async def test_a_released_lease_ends_its_term_released(dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("terms-release")
    before = db_now(dsn)
    async with pgcoord.Lease(pool, name, ttl=10.0, holder="alice") as fence:
        running = terms(dsn, name)
        assert running == [(fence, "alice", None, running[0][3], None, None, None)]
        assert before <= running[0][3] <= db_now(dsn)
    after = db_now(dsn)
    [(f, holder, _, started, ended, how, resign)] = terms(dsn, name)
    assert (f, holder, how, resign) == (fence, "alice", "released", None)
    assert isinstance(ended, dt.datetime) and isinstance(started, dt.datetime)
    assert started < ended <= after


async def test_expiry_then_a_takeover_by_another_lease_records_expired_at_the_expiry(
        dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("terms-expired")
    # A holder that stops renewing: taken for 300 ms by hand, never renewed.
    [(old_fence, expires_at)] = sql(dsn, "select fence, expires_at from pgcoord.lease_acquire("
                                         "%s, 'stalled', 300, null)", name)
    await asyncio.sleep(0.5)
    # Ran out, not yet taken: the history already shows it expired, at its expiry.
    assert sql(dsn, "select ended_at, ended_how from pgcoord.lease_history"
                    " where name = %s and fence = %s", name, old_fence) == [(expires_at, "expired")]
    assert terms(dsn, name)[0][5] is None  # nothing wrote the row yet
    async with pgcoord.Lease(pool, name, ttl=10.0, holder="bob") as fence:
        assert fence == old_fence + 1
        rows = terms(dsn, name)
    assert [(r[0], r[1], r[4], r[5]) for r in rows] == [
        (old_fence, "stalled", expires_at, "expired"), (fence, "bob", None, None)]


async def test_a_resign_asked_for_is_a_release_that_says_so(dsn: str) -> None:
    name = unique("terms-resign")
    led: asyncio.Queue[int] = asyncio.Queue()

    async def lead(fence: int) -> None:
        led.put_nowait(fence)
        await asyncio.Event().wait()

    elector = pgcoord.Elector(dsn, name, ttl=10.0, holder="leader")
    task = asyncio.create_task(elector.run(lead))
    try:
        first = await asyncio.wait_for(led.get(), 20)
        asked_at = db_now(dsn)
        assert await pgcoord.request_resign(dsn, name)
        await wait_for(lambda: terms(dsn, name)[0][5] is not None)
    finally:
        await elector.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    row = terms(dsn, name)[0]
    assert (row[0], row[1], row[5]) == (first, "leader", "released")
    assert isinstance(row[6], dt.datetime) and asked_at <= row[6] <= row[4]  # type: ignore[operator]
    assert row[2] is not None  # an elector's lease names its session
    assert advisory_locks(dsn) == []


@pytest.mark.slow
@pytest.mark.parametrize("on_member", [False, True], ids=["own-session", "member"])
async def test_a_leader_killed_ends_its_term_session_ended_when_a_follower_takes_over(
        dsn: str, children: list[subprocess.Popen[str]], on_member: bool) -> None:
    """SIGKILL of the leader's process, on its own session or on a member's (the member
    dies with it, its watcher settles it): the follower takes over long before the
    30 s ttl, and the term says the session ended, when it was taken over."""
    name = unique("terms-killed")
    proc, fence = spawn_leader(children, dsn, name, "doomed", on_member)
    [(pid,)] = sql(dsn, "select holder_pid from pgcoord.leases where name = %s", name)
    assert terms(dsn, name)[0][:3] == (fence, "doomed", pid)

    taken: asyncio.Queue[int] = asyncio.Queue()

    async def lead(f: int) -> None:
        taken.put_nowait(f)
        await asyncio.Event().wait()

    async def follow() -> None:
        if on_member:
            async with pgcoord.Member(dsn, group="terms", name=unique("heir")) as member:
                await pgcoord.Elector(member, name, ttl=30.0, holder="heir").run(lead)
        else:
            await pgcoord.Elector(dsn, name, ttl=30.0, holder="heir").run(lead)

    task = asyncio.create_task(follow())
    try:
        await asyncio.sleep(1.0)  # the follower waits on the doorbell
        killed_at = db_now(dsn)
        proc.send_signal(signal.SIGKILL)
        new_fence = await asyncio.wait_for(taken.get(), 20)
        rows = terms(dsn, name)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert new_fence == fence + 1
    (f, holder, hpid, _, ended, how, _), (f2, holder2, _, started2, ended2, _, _) = rows
    assert (f, holder, hpid, how) == (fence, "doomed", pid, "session_ended")
    assert isinstance(ended, dt.datetime)
    assert killed_at <= ended < killed_at + dt.timedelta(seconds=10)  # long before the ttl
    assert (f2, holder2, ended2) == (new_fence, "heir", None)
    assert ended <= started2  # type: ignore[operator]


async def test_a_forced_take_of_a_live_lease_is_taken_over(dsn: str, pool: asyncpg.Pool) -> None:
    name = unique("terms-forced")
    lease = pgcoord.Lease(pool, name, ttl=10.0, holder="victim")
    fence = await lease.acquire()
    try:
        forced = await pgcoord.testing.take_leadership(dsn, name, holder="intruder", ttl=5.0)
    finally:
        await lease.release()  # finds the row not its own any more: a no-op
    rows = terms(dsn, name)
    assert [(r[0], r[1], r[5]) for r in rows] == [
        (fence, "victim", "taken_over"), (forced, "intruder", None)]


async def test_a_partition_part_records_terms_too(dsn: str) -> None:
    """Parts are lease rows, changed by their own SQL: the triggers see them all."""
    name = unique("terms-parts")
    async with pgcoord.Member(dsn, group=unique("g")) as member:
        parts = pgcoord.Partitions(member, name, count=2)
        owned = asyncio.Event()

        async def own(part: pgcoord.Partition) -> None:
            owned.set()
            await asyncio.Event().wait()

        task = asyncio.create_task(parts.run(own))
        try:
            await asyncio.wait_for(owned.wait(), 20)
            await wait_for(lambda: len(sql(dsn, "select 1 from pgcoord.lease_terms where name like %s",
                                          name + "/%")) == 2)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    rows = sql(dsn, "select name, fence, ended_how from pgcoord.lease_terms where name like %s"
                    " order by name", name + "/%")
    assert rows == [(f"{name}/0", 1, "released"), (f"{name}/1", 1, "released")]


# -- retention -------------------------------------------------------------------------------


def test_retention_keeps_the_last_terms_of_each_name(dsn: str) -> None:
    """The last `kept` fences of each name, pruned every 8th fence: never fewer than
    kept, never more than kept + 7."""
    name, other = unique("terms-kept"), unique("terms-other")
    counts = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pgcoord.lease_acquire(%s, 'x', 60000, null)", (other,))
        conn.execute("set pgcoord.lease_terms_kept = 5")
        for i in range(1, 17):
            conn.execute("select pgcoord.lease_acquire(%s, %s, 60000, null)", (name, f"h{i}"))
            conn.execute("select pgcoord.lease_release(%s, %s, %s)", (name, f"h{i}", i))
            [(count,)] = conn.execute("select count(*) from pgcoord.lease_terms where name = %s",
                                      (name,)).fetchall()
            counts.append(count)
        assert conn.execute("select pgcoord.lease_terms_kept()").fetchone() == (5,)
        conn.execute("set pgcoord.lease_terms_kept = 'not a number'")  # never fails a takeover
        conn.execute("select pgcoord.lease_acquire(%s, 'h17', 60000, null)", (name,))
        assert conn.execute("select pgcoord.lease_terms_kept()").fetchone() == (50,)
    assert counts == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12, 5]
    kept = sql(dsn, "select fence, holder from pgcoord.lease_terms where name = %s order by fence", name)
    assert kept == [(f, f"h{f}") for f in range(12, 18)]
    assert len(terms(dsn, other)) == 1  # other names keep theirs


def test_the_default_keeps_fifty_and_zero_records_nothing(dsn: str) -> None:
    name, off = unique("terms-fifty"), unique("terms-off")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(1, 65):
            conn.execute("select pgcoord.lease_acquire(%s, 'h', 60000, null)", (name,))
            conn.execute("select pgcoord.lease_release(%s, 'h', %s)", (name, i))
        conn.execute("set pgcoord.lease_terms_kept = 0")
        conn.execute("select pgcoord.lease_acquire(%s, 'h', 60000, null)", (off,))
    assert sql(dsn, "select min(fence), max(fence), count(*) from pgcoord.lease_terms"
                    " where name = %s", name) == [(15, 64, 50)]
    assert terms(dsn, off) == []


def test_a_lease_row_deleted_by_hand_takes_its_history_along(dsn: str) -> None:
    name = unique("terms-deleted")
    sql(dsn, "select pgcoord.lease_acquire(%s, 'h', 60000, null)", name)
    sql(dsn, "delete from pgcoord.leases where name = %s", name)
    assert terms(dsn, name) == []


def test_renewals_write_nothing_to_the_history(dsn: str) -> None:
    name = unique("terms-renewed")
    [(fence,)] = sql(dsn, "select fence from pgcoord.lease_acquire(%s, 'h', 60000, null)", name)
    before = sql(dsn, "select xmin::text from pgcoord.lease_terms where name = %s", name)
    for _ in range(3):
        assert sql(dsn, "select count(*) from pgcoord.lease_renew(%s, 'h', %s, 60000)",
                   name, fence) == [(1,)]
    sql(dsn, "select pgcoord.request_resign(%s)", name)
    assert sql(dsn, "select xmin::text from pgcoord.lease_terms where name = %s", name) == before


# -- the migration ---------------------------------------------------------------------------


def test_0009_starts_the_record_with_the_held_leases_and_goes_down_and_up_again(
        fresh_db: str) -> None:
    pgcoord.migrations.upgrade(fresh_db, "0008")
    sql(fresh_db, "select pgcoord.lease_acquire('held', 'h', 60000, null)")
    sql(fresh_db, "select pgcoord.lease_acquire('gone', 'h', 60000, null)")
    sql(fresh_db, "select pgcoord.lease_release('gone', 'h', 1)")
    pgcoord.migrations.upgrade(fresh_db, "0009")
    assert sql(fresh_db, "select name, fence, holder, ended_at from pgcoord.lease_terms") == [
        ("held", 1, "h", None)]
    sql(fresh_db, "select pgcoord.lease_release('held', 'h', 1)")
    assert sql(fresh_db, "select ended_how from pgcoord.lease_terms") == [("released",)]
    pgcoord.migrations.downgrade(fresh_db, "0008")
    assert sql(fresh_db, "select to_regclass('pgcoord.lease_terms'), to_regclass('pgcoord.lease_history')"
               ) == [(None, None)]
    # 0008's lease functions and view work without the record.
    sql(fresh_db, "select pgcoord.lease_acquire('held', 'h2', 60000, null)")
    assert sql(fresh_db, "select name, holder from pgcoord.holders where kind = 'lease'") == [
        ("held", "h2")]
    pgcoord.migrations.upgrade(fresh_db)
    assert sql(fresh_db, "select name, fence, holder, ended_at from pgcoord.lease_terms") == [
        ("held", 2, "h2", None)]


def test_every_function_0009_makes_pins_its_search_path(dsn: str) -> None:
    rows = sql(dsn, "select p.proname, p.proconfig from pg_proc p"
                    " where p.pronamespace = 'pgcoord'::regnamespace"
                    " and p.proname in ('lease_terms_kept', 'lease_terms_record', 'lease_terms_forget',"
                    " 'lease_names_record')")
    assert len(rows) == 4
    for proname, config in rows:
        assert config == ["search_path=pg_catalog, pgcoord, pg_temp"], proname


def test_a_service_role_records_terms_without_a_grant_and_operators_read_them(
        pg_server: Server, fresh_db: str) -> None:
    """The triggers run as the schema's owner: roles.sql's service role takes and
    releases a lease (recorded, with lock names) holding no grant on lease_terms; the
    operator role reads the history and cannot write it."""
    pgcoord.migrations.upgrade(fresh_db)
    suffix = uuid.uuid4().hex[:6]
    service, operator = f"svc_{suffix}", f"ops_{suffix}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {service} login; create role {operator} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", service)
                      .replace("pgcoord_operator", operator))
    base = fresh_db.replace("postgres@", "{}@")
    try:
        with psycopg.connect(base.format(service), autocommit=True) as svc:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                svc.execute("select * from pgcoord.lease_terms")
            svc.execute("select pgcoord.lease_acquire('roles:terms', 's', 60000, null)")
            svc.execute("select pgcoord.lease_release('roles:terms', 's', 1)")
        with psycopg.connect(base.format(operator), autocommit=True) as ops:
            assert ops.execute("select holder, ended_how from pgcoord.lease_history"
                               " where name = 'roles:terms'").fetchall() == [("s", "released")]
            assert ops.execute("select count(*) from pgcoord.lease_terms").fetchone() == (1,)
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                ops.execute("delete from pgcoord.lease_terms")
        assert sql(fresh_db, "select name from pgcoord.lock_names where name like %s order by name",
                   "%roles:terms") == [("pgcoord.candidate:roles:terms",), ("pgcoord.elector:roles:terms",)]
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename in ('{service}', '{operator}')")
            admin.execute(f"drop owned by {service}; drop owned by {operator};"
                          f" drop role {service}; drop role {operator}")
