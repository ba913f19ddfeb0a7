"""pgcoord's functions mean the same whatever the caller's search_path (issue 23).

A role's own search_path may put a schema of its own before pg_catalog and pgcoord,
holding a table or a function of a name pgcoord uses. Every function of schema
pgcoord pins ``search_path = pg_catalog, pgcoord, pg_temp`` (migration 0010), and
the statements pgcoord sends on pool connections qualify every name.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.migrations

from .conftest import Server

PIN = "search_path=pg_catalog, pgcoord, pg_temp"

# Objects named as those pgcoord uses, in a schema the role's search_path puts first
# (even before pg_catalog, which then no longer comes first implicitly).
HOSTILE = """
create schema hostile;
create table hostile.leases (name text, holder text, fence bigint, expires_at timestamptz);
insert into hostile.leases values ('x', 'intruder', 999, 'infinity');
create table hostile.member_sessions (id integer, "group" text, left_at timestamptz);
create table hostile.job_slots (job text, slot_at timestamptz, state text);
create table hostile.schedules (name text);
create function hostile.clock_timestamp() returns timestamptz
    language sql as $$ select timestamptz '2000-01-01' $$;
create function hostile.now() returns timestamptz
    language sql as $$ select timestamptz '2000-01-01' $$;
create function hostile.pg_backend_pid() returns integer language sql as $$ select 0 $$;
create function hostile.pg_try_advisory_lock(bigint) returns boolean language sql as $$ select true $$;
create function hostile.pg_try_advisory_lock(integer, integer) returns boolean
    language sql as $$ select true $$;
create function hostile.pg_advisory_unlock(bigint) returns boolean language sql as $$ select true $$;
create function hostile.pg_notify(text, text) returns void
    language plpgsql as $$ begin raise exception 'hostile pg_notify'; end $$;
create function hostile.lock_key(text) returns bigint language sql as $$ select 42::bigint $$;
create function hostile.member_alive_ns() returns integer language sql as $$ select 1 $$;
create function hostile.ears_code(text) returns integer language sql as $$ select null::integer $$;
create function hostile.json_build_object(text, text) returns json
    language sql as $$ select '{}'::json $$;
create function hostile.quote_literal(text) returns text language sql as $$ select 'HIJACKED' $$;
create function hostile.max_sf(timestamptz, timestamptz) returns timestamptz
    language sql as $$ select timestamptz '1970-01-01' $$;
create aggregate hostile.max(timestamptz) (sfunc = hostile.max_sf, stype = timestamptz);
create function hostile.count_sf(bigint) returns bigint language sql as $$ select 1000::bigint $$;
create aggregate hostile.count(*) (sfunc = hostile.count_sf, stype = bigint, initcond = '1000');
create function hostile.never_equal(integer, integer) returns boolean
    language sql immutable as $$ select false $$;
create operator hostile.= (leftarg = integer, rightarg = integer, function = hostile.never_equal);
"""


@pytest.fixture(scope="module")
def hostile_dsn(pg_server: Server) -> Iterator[str]:
    """A database with pgcoord at head, and a role whose search_path starts with a
    hostile schema (a superuser, so that privileges are not what is tested)."""
    dbname = f"pgcoord_hostile_{uuid.uuid4().hex[:8]}"
    role = f"hostile_{uuid.uuid4().hex[:8]}"
    janitor = pg_server.janitor(dbname)
    janitor.init()
    url = pg_server.dsn(dbname)
    pgcoord.migrations.upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(HOSTILE)  # type: ignore[arg-type]
        conn.execute(f"create role {role} login superuser")
        conn.execute(f"alter role {role} set search_path = hostile, pg_catalog, pgcoord, public")
    hostile = url.replace("postgresql://postgres@", f"postgresql://{role}@", 1)
    assert hostile != url
    with psycopg.connect(hostile, autocommit=True) as conn:
        # The role really sees the hostile objects first.
        assert conn.execute("select clock_timestamp()").fetchone() == (
            conn.execute("select timestamptz '2000-01-01'").fetchone())
        assert conn.execute("select 1::integer = 1::integer").fetchone() == (False,)
        assert conn.execute("select count(*) from pg_class").fetchone() == (1000,)
    try:
        yield hostile
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                         " where usename = %s", (role,))
        janitor.drop()
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"drop role if exists {role}")


@pytest.fixture
async def pool(hostile_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(hostile_dsn, min_size=1, max_size=4)
    try:
        yield p
    finally:
        await p.close()


def unpinned(dsn: str) -> list[str]:
    """Functions of the schema whose meaning a caller's search_path could change: a
    string body (parsed at each call, under the caller's search_path) without the
    pinned search_path. A SQL-standard body (RETURN, BEGIN ATOMIC) is bound when
    created, and is left unpinned so that the planner can inline it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(r[0]) for r in conn.execute(
            "select p.oid::regprocedure::text from pg_proc p"
            " where p.pronamespace = 'pgcoord'::regnamespace and p.prokind in ('f', 'p')"
            "   and p.prosqlbody is null"
            "   and not coalesce(%s = any(p.proconfig), false) order by 1", (PIN,)).fetchall()]


def test_every_function_of_the_schema_pins_its_search_path_or_is_bound_when_created(dsn: str) -> None:
    """Fails for any function a later migration creates or replaces without the clause."""
    assert unpinned(dsn) == []
    with psycopg.connect(dsn, autocommit=True) as conn:
        # The live-member read is inlined into pgcoord.members (the heartbeat's hot path).
        assert conn.execute("select prosqlbody is not null and proconfig is null from pg_proc"
                            " where oid = 'pgcoord.member_sessions_alive()'::regprocedure").fetchone() == (True,)


def test_the_pin_survives_going_down_and_up_again(fresh_db: str) -> None:
    pgcoord.migrations.upgrade(fresh_db)
    assert unpinned(fresh_db) == []
    revisions = pgcoord.migrations.revisions()
    below = revisions[revisions.index("0010") - 1]
    pgcoord.migrations.downgrade(fresh_db, below)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert conn.execute("select to_regproc('pgcoord.notify_heard')").fetchone() == (None,)
        # 0004's and 0006's news is told again whoever listens.
        # A handler: psycopg 3.2 (the oldest declared) hands a notification that
        # arrives with a statement's answer to handlers, not to notifies().
        heard: list[str] = []
        conn.add_notify_handler(lambda n: heard.append(n.payload))
        conn.execute("listen pgcoord_leases")
        conn.execute("select pgcoord.lease_acquire('down', 'h', 1000, null)")
        assert len(heard) == 1
    pgcoord.migrations.upgrade(fresh_db)
    assert pgcoord.migrations.current(fresh_db) == pgcoord.migrations.head()
    assert unpinned(fresh_db) == []


async def test_a_lease_on_a_hostile_search_path(hostile_dsn: str, pool: asyncpg.Pool) -> None:
    name = f"hostile-lease-{uuid.uuid4().hex[:6]}"
    lease = pgcoord.Lease(pool, name, ttl=5.0, holder="me")
    fence = await lease.acquire()
    async with pool.acquire() as conn, conn.transaction():
        await pgcoord.check_fence(conn, name, fence)
        row = await conn.fetchrow("select holder, fence, expires_at > pg_catalog.clock_timestamp() as live"
                                  " from pgcoord.leases where name = $1", name)
    assert (row["holder"], row["fence"], row["live"]) == ("me", fence, True)
    await lease.release()
    other = pgcoord.Lease(pool, name, ttl=5.0, holder="other")
    assert await other.acquire() == fence + 1
    with pytest.raises(pgcoord.StaleFence) as stale:
        async with pool.acquire() as conn, conn.transaction():
            await pgcoord.check_fence(conn, name, fence)
    assert name in str(stale.value) and "HIJACKED" not in str(stale.value)
    await other.release()


async def test_an_elector_on_a_hostile_search_path(hostile_dsn: str) -> None:
    name = f"hostile-election-{uuid.uuid4().hex[:6]}"
    led: list[tuple[str, int]] = []

    def lead_as(who: str) -> object:
        async def lead(fence: int) -> None:
            led.append((who, fence))
            await asyncio.sleep(3600)
        return lead

    a = pgcoord.Elector(hostile_dsn, name, ttl=10.0, holder="a")
    b = pgcoord.Elector(hostile_dsn, name, ttl=10.0, holder="b")
    runs = [asyncio.create_task(a.run(lead_as("a"))),  # type: ignore[arg-type]
            asyncio.create_task(b.run(lead_as("b")))]  # type: ignore[arg-type]
    try:
        for _ in range(500):
            if led:
                break
            await asyncio.sleep(0.02)
        assert len(led) == 1
        first, fence = led[0]
        assert await a.leader() == first
        leader, follower = (a, b) if first == "a" else (b, a)
        await leader.stop()
        for _ in range(150):
            if len(led) == 2:
                break
            await asyncio.sleep(0.02)
        assert led[1] == (follower.holder, fence + 1)
    finally:
        await a.stop()
        await b.stop()
        await asyncio.gather(*runs, return_exceptions=True)


async def test_members_on_a_hostile_search_path(hostile_dsn: str) -> None:
    group = f"hostile-{uuid.uuid4().hex[:6]}"
    async with pgcoord.Member(hostile_dsn, group=group, ttl=3.0) as a, \
            pgcoord.Member(hostile_dsn, group=group, ttl=3.0) as b:
        assert sorted(p.id for p in await a.peers()) == sorted([a.id, b.id])  # type: ignore[type-var]
        b_id = b.id
        with psycopg.connect(hostile_dsn, autocommit=True) as conn:
            conn.execute("select pg_catalog.pg_terminate_backend(%s)",
                         (b._main.backend_pid,))  # type: ignore[union-attr]
        for _ in range(250):
            if b_id not in {p.id for p in await a.peers()}:
                break
            await asyncio.sleep(0.02)
        assert b_id not in {p.id for p in await a.peers()}


async def test_a_scheduler_on_a_hostile_search_path(hostile_dsn: str, pool: asyncpg.Pool) -> None:
    job = f"hostile-job-{uuid.uuid4().hex[:6]}"
    ran = asyncio.Event()
    s = pgcoord.Scheduler(pool, runner="hostile")

    @s.cron(job, "* * * * * *")
    async def tick(slot: object) -> None:
        ran.set()

    run = asyncio.create_task(s.run())
    try:
        await asyncio.wait_for(ran.wait(), 10)
        await s.trigger(job)
    finally:
        await s.stop()
        await asyncio.gather(run, return_exceptions=True)
    async with pool.acquire() as conn:
        states = await conn.fetch("select state from pgcoord.job_slots where job = $1", job)
    assert states and {r["state"] for r in states} <= {"succeeded", "running"}
