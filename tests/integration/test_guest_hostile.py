"""Trying to break the good guest (issue 23): settings, foreign cancels and terminations
aimed at pgcoord's own sessions at awkward moments, on a real server.

Each test names what an operator, a tool or a DBA does, and checks what the user would
check afterwards: member ids stable, no spurious ``MemberLeft(crashed)``, elector terms
unmoved, pg_locks empty, connections given back as they came.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest

import pgcoord
import pgcoord.migrations

from .conftest import Server, sql

DRIVERS = ["asyncpg", "psycopg"]


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def wait_for(predicate: object, within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not true within {within}s"
        await asyncio.sleep(0.02)


async def collect(watch: object, into: list[object]) -> None:
    async for change in watch:  # type: ignore[attr-defined]
        into.append(change)


def departures(changes: list[object]) -> list[object]:
    return [c for c in changes if isinstance(c, pgcoord.MemberLeft)]


def main_pid(member: pgcoord.Member) -> int:
    assert member._main is not None
    return member._main.backend_pid


# -- a member's main session: a statement cut short is not a lost session -----------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_heartbeat_cut_by_a_row_lock_or_a_foreign_cancel_keeps_the_member(
    dsn: str, driver: str,
) -> None:
    """An operator's transaction holds the member's row (SELECT ... FOR UPDATE on
    pgcoord.member_sessions, a migration's ALTER TABLE) past the main session's own
    500 ms lock_timeout, and an operator cancels the heartbeat while it waits: the
    member's session is alive all along, so its id stays and nobody is told it left."""
    g = group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", ttl=1.5, driver=driver) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", ttl=1.5, driver=driver) as b:
        seen: list[object] = []
        task = asyncio.ensure_future(collect(b.watch(), seen))
        ids, pid = (a.id, b.id), main_pid(a)
        try:
            blocker = await asyncpg.connect(dsn)
            try:
                tx = blocker.transaction()
                await tx.start()
                await blocker.execute("select 1 from pgcoord.member_sessions where id = $1 for update", a.id)
                await asyncio.sleep(1.5)  # three heartbeats cut by lock_timeout
                # The next heartbeat waits for the row: cancel it as an operator would.
                await wait_for(lambda: sql(dsn, "select 1 from pg_stat_activity where pid = %s "
                                                "and wait_event_type = 'Lock'", pid) != [], 5)
                sql(dsn, "select pg_cancel_backend(%s)", pid)
                await asyncio.sleep(0.3)
                await tx.rollback()
            finally:
                await blocker.close()
            await asyncio.sleep(1.0)
            assert (a.id, b.id) == ids
            assert main_pid(a) == pid
            assert departures(seen) == []
            assert a.has_session
        finally:
            task.cancel()


# -- transaction_timeout (PostgreSQL 17+) on pgcoord's waits on a pool ---------------------


def server_major(pg_server: Server) -> int:
    with psycopg.connect(pg_server.dsn("postgres")) as conn:
        return int(conn.execute("show server_version_num").fetchone()[0]) // 10000  # type: ignore[index]


def _database(pg_server: Server, settings: dict[str, str]) -> Iterator[str]:
    dbname = f"pgcoord_guest_{uuid.uuid4().hex[:8]}"
    janitor = pg_server.janitor(dbname)
    janitor.init()
    url = pg_server.dsn(dbname)
    pgcoord.migrations.upgrade(url)
    with psycopg.connect(url, autocommit=True) as conn:
        for name, value in settings.items():
            conn.execute(f"ALTER DATABASE {dbname} SET {name} = '{value}'")
    try:
        yield url
    finally:
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s",
                         (dbname,))
        janitor.drop()


@pytest.fixture(scope="module")
def tx_timeout_db(pg_server: Server) -> Iterator[str]:
    """transaction_timeout where the server has it (17+), else the nearest a 15 has:
    statement_timeout (so the tests run, and mean something, on every server)."""
    if server_major(pg_server) >= 17:
        yield from _database(pg_server, {"transaction_timeout": "1s"})
    else:
        yield from _database(pg_server, {"statement_timeout": "1s"})


def a_key() -> int:
    return int(uuid.uuid4().int % 2**62)


async def hold_for(dsn: str, key: int, seconds: float) -> asyncio.Task[None]:
    conn = await asyncpg.connect(dsn)
    await conn.execute(f"select pg_advisory_lock({key})")

    async def release() -> None:
        try:
            await asyncio.sleep(seconds)
        finally:
            await conn.close()

    return asyncio.ensure_future(release())


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_exclusive_without_timeout_waits_past_transaction_timeout(tx_timeout_db: str, kind: str) -> None:
    from .sources import open_async

    key = a_key()
    async with open_async(kind, tx_timeout_db, size=1) as pool:
        holder = await hold_for(tx_timeout_db, key, 2.5)
        started = time.monotonic()
        async with asyncio.timeout(20), pgcoord.exclusive(pool, key):
            assert time.monotonic() - started > 2.0
        await holder
        assert sql(tx_timeout_db, "select count(*) from pg_locks where locktype = 'advisory'") == [(0,)]


# -- idle_session_timeout on a pool of one ------------------------------------------------


@pytest.fixture(scope="module")
def idle_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {"idle_session_timeout": "700ms"})


async def show(conn: object, name: str) -> str:
    if hasattr(conn, "fetchval"):  # asyncpg
        return str(await conn.fetchval(f"show {name}"))
    return str((await (await conn.execute(f"show {name}")).fetchone())[0])  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_a_lease_held_on_the_smallest_pool_outlives_idle_session_timeout(idle_db: str, kind: str) -> None:
    from .sources import open_async

    name = f"idle-lease-{uuid.uuid4().hex[:8]}"
    async with open_async(kind, idle_db, size=2) as pool:  # a pool of one is refused at the call
        lease = pgcoord.Lease(pool, name, ttl=3.0)  # renewed every second: the pool's
        async with lease as fence:                  # connections are ended between renewals
            await asyncio.sleep(4.0)
            assert lease.valid and lease.fence == fence
            assert sql(idle_db, "select fence from pgcoord.leases where name = %s", name) == [(fence,)]
        # Another holder on the same pool gets it at once, under the next fence.
        async with asyncio.timeout(10), pgcoord.Lease(pool, name, ttl=3.0) as second:
            assert second == fence + 1


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_a_lock_holder_on_a_pool_of_one_keeps_its_lock_past_idle_session_timeout(
    idle_db: str, kind: str,
) -> None:
    from .sources import open_async

    key = a_key()
    async with open_async(kind, idle_db, size=1) as pool:
        async with pgcoord.exclusive(pool, a_key()) as conn:
            before = [await show(conn, n) for n in ("idle_session_timeout", "lock_timeout",
                                                    "search_path", "application_name")]
        async with pgcoord.LockHolder(pool) as locks:
            async with locks.lock(key):
                await asyncio.sleep(2.0)
                assert sql(idle_db, "select count(*) from pg_locks where locktype = 'advisory' "
                                    "and granted") == [(1,)]
                other = await asyncpg.connect(idle_db)
                try:
                    assert await other.fetchval("select pg_try_advisory_lock($1)", key) is False
                finally:
                    await other.close()
        async with pgcoord.exclusive(pool, a_key()) as conn:
            after = [await show(conn, n) for n in ("idle_session_timeout", "lock_timeout",
                                                   "search_path", "application_name")]
        assert after == before
        assert sql(idle_db, "select count(*) from pg_locks where locktype = 'advisory'") == [(0,)]


# -- a role whose search_path has no pgcoord in it ----------------------------------------


@pytest.fixture(scope="module")
def plain_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {})


@pytest.fixture(scope="module")
def lost_role(plain_db: str) -> Iterator[str]:
    """A role whose search_path names a schema of its own (which has none of pgcoord's
    objects) then one that does not exist: nothing of pgcoord's is found by name."""
    role = f"pgcoord_guest_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(plain_db, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        conn.execute(f"CREATE SCHEMA {role}_own AUTHORIZATION {role}")
        conn.execute(f"ALTER ROLE {role} SET search_path = {role}_own, nowhere")
    try:
        yield plain_db.replace("postgres@", f"{role}@", 1)
    finally:
        with psycopg.connect(plain_db, autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where usename = %s",
                         (role,))
            conn.execute(f"DROP SCHEMA {role}_own CASCADE")
            conn.execute(f"REASSIGN OWNED BY {role} TO postgres")
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_every_pool_feature_works_for_a_role_whose_search_path_lacks_pgcoord(
    lost_role: str, kind: str,
) -> None:
    from .sources import open_async

    dsn, tag = lost_role, uuid.uuid4().hex[:8]
    async with open_async(kind, dsn, size=3) as pool:
        async with pgcoord.exclusive(pool, f"named-{tag}") as conn:
            assert (await show(conn, "search_path")).endswith("nowhere")
        async with pgcoord.Lease(pool, f"lease-{tag}", ttl=3.0) as fence:
            async with pgcoord.exclusive(pool, a_key()) as conn:
                await pgcoord.check_fence(conn, f"lease-{tag}", fence)
        async with pgcoord.semaphore(pool, f"sem-{tag}", limit=2):
            pass
        async with pgcoord.LockHolder(pool) as locks:
            async with locks.lock(f"held-{tag}"), locks.semaphore(f"hsem-{tag}", limit=1):
                pass
        s = pgcoord.Scheduler(pool)
        ran: list[object] = []

        @s.cron(f"job-{tag}", "0 0 1 1 *")
        async def work(slot: object) -> None:
            ran.append(slot)

        await asyncio.wait_for(s.trigger(f"job-{tag}"), 30)
        assert len(ran) == 1
        async with pgcoord.exclusive(pool, a_key()) as conn:
            assert (await show(conn, "search_path")).endswith("nowhere")
    g = group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}") as a:
        leading = asyncio.Event()

        async def lead(_fence: int) -> None:
            leading.set()
            await asyncio.Event().wait()

        for elector in (pgcoord.Elector(dsn, f"el-{tag}", ttl=3.0), pgcoord.Elector(a, f"mel-{tag}", ttl=3.0)):
            leading.clear()
            task = asyncio.ensure_future(elector.run(lead))
            try:
                await asyncio.wait_for(leading.wait(), 15)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    assert sql(plain_db_of(dsn), "select count(*) from pg_locks where locktype = 'advisory'") == [(0,)]


def plain_db_of(role_dsn: str) -> str:
    return "postgresql://postgres@" + role_dsn.split("@", 1)[1]


# -- found on the way: a statement without a result on a psycopg session ------------------


@pytest.mark.parametrize("source", ["psycopg-pool", "psycopg-dsn"])
async def test_a_lock_holder_semaphore_on_psycopg_keeps_the_holders_other_locks(
    plain_db: str, source: str,
) -> None:
    """A LockHolder's semaphore records its name (an INSERT with no result) on the
    holder's session: on psycopg that read as a broken session, and every lock the
    holder held was lost."""
    from .sources import open_async

    tag = uuid.uuid4().hex[:8]
    async with open_async("psycopg-pool", plain_db, size=2) as pool:
        holder = pgcoord.LockHolder(pool) if source == "psycopg-pool" else \
            pgcoord.LockHolder(plain_db, driver="psycopg")
        async with holder as locks, locks.lock(f"held-{tag}") as held:
            async with locks.semaphore(f"sem-{tag}", limit=1):
                pass
            assert held.lost_reason is None
        assert sql(plain_db, 'select "limit" from pgcoord.semaphores where name = %s', f"sem-{tag}") == [(1,)]
    assert sql(plain_db, "select count(*) from pg_locks where locktype = 'advisory'") == [(0,)]


async def test_an_elector_on_psycopg_names_its_doorbell(plain_db: str) -> None:
    name = f"el-{uuid.uuid4().hex[:8]}"
    leading = asyncio.Event()

    async def lead(_fence: int) -> None:
        leading.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(pgcoord.Elector(plain_db, name, ttl=3.0, driver="psycopg").run(lead))
    try:
        await asyncio.wait_for(leading.wait(), 15)
        assert sql(plain_db, "select count(*) from pgcoord.lock_names where name = %s",
                   f"pgcoord.elector:{name}") == [(1,)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
