"""Whatever the DBA sets, pgcoord keeps its word (issue 23, DESIGN "Cross-cutting rules").

Each fixture makes a database (ALTER DATABASE ... SET) or a role (ALTER ROLE ... SET)
carrying hostile settings, so that no other test file sees them. The CI settings
suite also runs this file against a server started with production-like settings
(PGCOORD_TEST_SERVER_SETTINGS).
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

from .conftest import Server, migrated_database, sql
from .sources import open_async

DRIVERS = ["asyncpg", "psycopg"]


def _database(pg_server: Server, settings: dict[str, str]) -> Iterator[str]:
    yield from migrated_database(pg_server, "pgcoord_dba", settings)


def _role(pg_server: Server, url: str, settings: dict[str, str]) -> Iterator[str]:
    """A DSN for ``url``'s database as a role of its own carrying ``settings``."""
    role = f"pgcoord_dba_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        for name, value in settings.items():
            conn.execute(f"ALTER ROLE {role} SET {name} = '{value}'")
    try:
        yield url.replace("postgres@", f"{role}@", 1)
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where usename = %s",
                         (role,))
            conn.execute(f"DROP ROLE {role}")


@pytest.fixture(scope="module")
def lock_timeout_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {"lock_timeout": "1s"})


@pytest.fixture(scope="module")
def plain_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {})


@pytest.fixture(scope="module")
def lock_timeout_role(pg_server: Server, plain_db: str) -> Iterator[str]:
    yield from _role(pg_server, plain_db, {"lock_timeout": "1s", "search_path": "nowhere"})


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def watcher_pid(dsn: str, name: str) -> int | None:
    rows = sql(dsn, "select pid from pg_stat_activity where application_name = %s",
               f"pgcoord-member:{name}/watch")
    return int(rows[0][0]) if rows else None  # type: ignore[call-overload]


async def wait_for(predicate: object, within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not true within {within}s"
        await asyncio.sleep(0.05)


def departures(changes: list[object]) -> list[object]:
    return [c for c in changes if isinstance(c, pgcoord.MemberLeft)]


async def collect(watch: object, into: list[object]) -> None:
    async for change in watch:  # type: ignore[attr-defined]
        into.append(change)


# -- 1. a member's own sessions are never cut by a setting -----------------------------


@pytest.mark.parametrize("where", ["database", "role"])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_lock_timeout_never_drops_a_member_with_a_successor(
    lock_timeout_db: str, lock_timeout_role: str, where: str, driver: str,
) -> None:
    dsn = lock_timeout_db if where == "database" else lock_timeout_role
    g = group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", driver=driver) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", driver=driver) as b:
        ids = (a.id, b.id)
        seen: list[object] = []
        task = asyncio.ensure_future(collect(a.watch(), seen))
        try:
            # Both watchers wait on each other's alive lock for 3x the lock_timeout.
            await wait_for(lambda: watcher_pid(dsn, a.name) and watcher_pid(dsn, b.name), 10)
            await asyncio.sleep(2.5)  # over twice the lock_timeout
            assert (a.id, b.id) == ids
            assert departures(seen) == []
            assert a.has_session and b.has_session
        finally:
            task.cancel()


@pytest.fixture(scope="module")
def session_ending_db(pg_server: Server) -> Iterator[str]:
    """Settings that end a session: transaction_timeout where the server has it
    (PostgreSQL 17+), idle_in_transaction_session_timeout everywhere."""
    with psycopg.connect(pg_server.dsn("postgres")) as conn:
        major = int(conn.execute("show server_version_num").fetchone()[0]) // 10000  # type: ignore[index]
    settings = {"idle_in_transaction_session_timeout": "1s"}
    if major >= 17:
        settings["transaction_timeout"] = "1s"
    yield from _database(pg_server, settings)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_transaction_timeout_never_ends_a_members_waits(session_ending_db: str, driver: str) -> None:
    dsn, g = session_ending_db, group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", driver=driver) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", driver=driver) as b:
        ids = (a.id, b.id)
        await wait_for(lambda: watcher_pid(dsn, a.name) and watcher_pid(dsn, b.name), 10)
        watchers = (watcher_pid(dsn, a.name), watcher_pid(dsn, b.name))
        await asyncio.sleep(3.0)  # each watcher's one statement outlasts the timeouts
        assert (a.id, b.id) == ids
        assert (watcher_pid(dsn, a.name), watcher_pid(dsn, b.name)) == watchers


# -- 2. losing only the watcher reopens the watcher -------------------------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_terminating_only_the_watcher_keeps_the_member(plain_db: str, driver: str) -> None:
    dsn, g = plain_db, group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", driver=driver) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", driver=driver) as b:
        seen: list[object] = []
        task = asyncio.ensure_future(collect(b.watch(), seen))
        try:
            await wait_for(lambda: watcher_pid(dsn, a.name) is not None, 10)
            old_watcher, a_id, b_id = watcher_pid(dsn, a.name), a.id, b.id
            main_pid = a._main.backend_pid  # type: ignore[union-attr]
            sql(dsn, "select pg_terminate_backend(%s)", old_watcher)
            await wait_for(lambda: watcher_pid(dsn, a.name) not in (None, old_watcher), 15)
            await asyncio.sleep(1.0)
            assert (a.id, b.id) == (a_id, b_id)
            assert a._main.backend_pid == main_pid  # type: ignore[union-attr]
            assert departures(seen) == []
            # The new watcher still tells a death at once.
            await b.close()
            await wait_for(lambda: [p.name for p in a._view.values()] == [a.name], 10)
        finally:
            task.cancel()


# -- 3. timeout=None means "until granted" ------------------------------------------------


@pytest.fixture(scope="module")
def timeouts_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {"lock_timeout": "1s", "statement_timeout": "1500ms"})


async def show(conn: object, name: str) -> str:
    """SHOW ``name`` on a driver connection exclusive() yielded (any driver)."""
    if hasattr(conn, "fetchval"):  # asyncpg
        return str(await conn.fetchval(f"show {name}"))
    if type(conn).__module__.startswith("sqlalchemy"):
        from sqlalchemy import text
        return str((await conn.execute(text(f"show {name}"))).scalar())  # type: ignore[attr-defined]
    return str((await (await conn.execute(f"show {name}")).fetchone())[0])  # type: ignore[attr-defined]


async def hold_for(dsn: str, key: int, seconds: float, *, shared: bool = False) -> asyncio.Task[None]:
    """Another session holds session lock ``key`` for ``seconds``; returns once it holds it."""
    conn = await asyncpg.connect(dsn)
    await conn.execute(f"select pg_advisory_lock{'_shared' if shared else ''}({key})")

    async def release() -> None:
        try:
            await asyncio.sleep(seconds)
        finally:
            await conn.close()

    return asyncio.ensure_future(release())


def a_key() -> int:
    return int(uuid.uuid4().int % 2**62)


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool", "sa-async-asyncpg", "sa-async-psycopg"])
async def test_exclusive_without_timeout_waits_past_lock_and_statement_timeout(
    timeouts_db: str, kind: str,
) -> None:
    key = a_key()
    async with open_async(kind, timeouts_db, size=1) as pool:
        holder = await hold_for(timeouts_db, key, 3.0)
        started = time.monotonic()
        async with pgcoord.exclusive(pool, key) as conn:
            waited = time.monotonic() - started
            # Nothing pgcoord set for its one statement is left in the caller's transaction.
            assert (await show(conn, "lock_timeout"), await show(conn, "statement_timeout")) == (
                "1s", "1500ms")
        assert waited > 2.0
        await holder
        # Nor on the connection back in the pool (the pool has one).
        async with pgcoord.exclusive(pool, a_key(), wait=False) as conn:
            assert (await show(conn, "lock_timeout"), await show(conn, "statement_timeout")) == (
                "1s", "1500ms")


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_exclusive_without_timeout_inside_the_callers_transaction(timeouts_db: str, kind: str) -> None:
    key = a_key()
    async with open_async(kind, timeouts_db, size=1) as pool:
        holder = await hold_for(timeouts_db, key, 3.0)
        async with pgcoord.exclusive(pool, a_key()) as conn:
            # The caller's own setting, made in its transaction, is what stays.
            await conn.execute("set local lock_timeout = '1200ms'")
            async with pgcoord.exclusive(conn, key):
                assert (await show(conn, "lock_timeout"), await show(conn, "statement_timeout")) == (
                    "1200ms", "1500ms")
        await holder


@pytest.mark.parametrize("source", ["dsn", "asyncpg-pool"])
async def test_lock_holder_without_timeout_waits_past_lock_timeout(timeouts_db: str, source: str) -> None:
    key = a_key()
    async with open_async("asyncpg-pool", timeouts_db, size=3) as pool:
        holder = await hold_for(timeouts_db, key, 3.0)
        async with pgcoord.LockHolder(timeouts_db if source == "dsn" else pool) as locks:
            started = time.monotonic()
            async with locks.lock(key):
                assert time.monotonic() - started > 2.0
        await holder
        if source != "dsn":
            # The pool's connections went back as they came.
            async with pool.acquire() as conn:
                assert (await conn.fetchval("show lock_timeout"),
                        await conn.fetchval("show statement_timeout")) == ("1s", "1500ms")


async def test_a_lock_timeout_message_never_reads_none(timeouts_db: str) -> None:
    from pgcoord.locks.advisory import LockRequest
    request = LockRequest(1, wait=True, timeout=None, shared=False)

    class Err(Exception):
        sqlstate = "55P03"

    message = str(request.translate(Err()))
    assert "None" not in message and "lock_timeout" in message


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_semaphores_without_timeout_wait_past_lock_and_statement_timeout(
    timeouts_db: str, kind: str,
) -> None:
    name = f"sem-{uuid.uuid4().hex[:8]}"
    async with open_async(kind, timeouts_db, size=3) as pool, \
            pgcoord.LockHolder(pool) as locks:
        entered = asyncio.Event()

        async def first() -> None:
            async with pgcoord.semaphore(pool, name, limit=1):
                entered.set()
                await asyncio.sleep(3.0)

        task = asyncio.ensure_future(first())
        await asyncio.wait_for(entered.wait(), 10)
        started = time.monotonic()
        async with pgcoord.semaphore(pool, name, limit=1) as conn:
            assert time.monotonic() - started > 2.0
            assert (await show(conn, "lock_timeout"), await show(conn, "statement_timeout")) == (
                "1s", "1500ms")
        await task
        entered.clear()  # else the wait below returns before the second holder is in
        task = asyncio.ensure_future(first())
        await asyncio.wait_for(entered.wait(), 10)
        started = time.monotonic()
        async with locks.semaphore(name, limit=1):
            assert time.monotonic() - started > 2.0
        await task


async def test_an_elector_follower_keeps_its_session_under_statement_timeout(timeouts_db: str) -> None:
    name = f"el-{uuid.uuid4().hex[:8]}"
    leading = asyncio.Event()

    async def lead(_fence: int) -> None:
        leading.set()
        await asyncio.Event().wait()

    leader = pgcoord.Elector(timeouts_db, name, holder="leader", ttl=10)
    follower = pgcoord.Elector(timeouts_db, name, holder="follower", ttl=10)
    app = f"pgcoord-elector:{name}"
    tasks = [asyncio.ensure_future(leader.run(lead))]
    try:
        await asyncio.wait_for(leading.wait(), 15)
        tasks.append(asyncio.ensure_future(follower.run(lead)))
        await wait_for(lambda: len(sql(timeouts_db, "select pid from pg_stat_activity where "
                                                    "application_name = %s", app)) == 2, 15)
        pids = set(sql(timeouts_db, "select pid from pg_stat_activity where application_name = %s", app))
        await asyncio.sleep(4.0)  # the follower's doorbell wait outlasts statement_timeout
        assert set(sql(timeouts_db, "select pid from pg_stat_activity where application_name = %s",
                       app)) == pids
        assert leader.is_leader and not follower.is_leader
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- 4. default_transaction_isolation = serializable ---------------------------------------


@pytest.fixture(scope="module")
def serializable_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {"default_transaction_isolation": "serializable"})


@pytest.mark.parametrize("driver", DRIVERS)
async def test_eight_members_open_at_once_under_serializable(serializable_db: str, driver: str) -> None:
    g = group()
    members = [pgcoord.Member(serializable_db, group=g, name=f"m{i}-{g}", driver=driver) for i in range(8)]
    results = await asyncio.gather(*(m.open() for m in members), return_exceptions=True)
    try:
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert len({m.id for m in members}) == 8
    finally:
        await asyncio.gather(*(m.close() for m in members if m._open), return_exceptions=True)


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_eight_leases_on_a_pool_under_serializable(serializable_db: str, kind: str) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    fences: list[int] = []
    async with open_async(kind, serializable_db, size=8) as pool:

        async def actor() -> None:
            async with pgcoord.Lease(pool, name, ttl=1.5) as fence:  # waiters look every ttl/3
                fences.append(fence)
                await asyncio.sleep(0.05)

        results = await asyncio.wait_for(
            asyncio.gather(*(actor() for _ in range(8)), return_exceptions=True), 90)
    assert [r for r in results if isinstance(r, BaseException)] == []
    assert sorted(fences) == fences and len(set(fences)) == 8


@pytest.mark.parametrize("where", ["database", "role"])
async def test_partitions_stay_put_under_lock_timeout(
    lock_timeout_db: str, lock_timeout_role: str, where: str,
) -> None:
    dsn = lock_timeout_db if where == "database" else lock_timeout_role
    name, count = f"parts-{uuid.uuid4().hex[:8]}", 8
    starts: list[tuple[str, int]] = []

    def owner(who: str) -> object:
        async def own(part: pgcoord.Partition) -> None:
            starts.append((who, part.index))
            await asyncio.Event().wait()
        return own

    g = group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}") as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}") as b:
        pa, pb = pgcoord.Partitions(a, name, count=count), pgcoord.Partitions(b, name, count=count)
        tasks = [asyncio.ensure_future(pa.run(owner("a"))),  # type: ignore[arg-type]
                 asyncio.ensure_future(pb.run(owner("b")))]  # type: ignore[arg-type]
        try:
            await wait_for(lambda: len(pa.owned) == len(pb.owned) == count // 2 and len(starts) >= count, 30)
            await asyncio.sleep(0.5)
            settled = len(starts)
            owned = (pa.owned, pb.owned)
            await asyncio.sleep(2.5)  # over twice the lock_timeout
            assert (pa.owned, pb.owned) == owned
            assert len(starts) == settled
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# -- 5. a setting that makes a promise impossible is named at once -------------------------


@pytest.fixture(scope="module")
def read_only_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {"default_transaction_read_only": "on"})


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_a_read_only_default_is_named_for_pool_statements(read_only_db: str, kind: str) -> None:
    async with open_async(kind, read_only_db, size=2) as pool:
        with pytest.raises(pgcoord.PgcoordError, match="default_transaction_read_only") as raised:
            async with asyncio.timeout(20):
                await pgcoord.Lease(pool, f"ro-{uuid.uuid4().hex[:8]}", ttl=5.0).acquire()
        assert "ALTER ROLE" in str(raised.value)
        # exclusive() takes only advisory locks: it works in a read-only transaction.
        async with pgcoord.exclusive(pool, a_key()) as conn:
            assert await show(conn, "transaction_read_only") == "on"


async def test_check_fence_in_a_read_only_transaction_names_the_setting(read_only_db: str) -> None:
    conn = await asyncpg.connect(read_only_db)
    try:
        async with conn.transaction():
            with pytest.raises(pgcoord.PgcoordError, match="default_transaction_read_only"):
                await pgcoord.check_fence(conn, f"ro-{uuid.uuid4().hex[:8]}", 1)
    finally:
        await conn.close()


@pytest.mark.parametrize("driver", DRIVERS)
async def test_members_and_lock_holders_work_under_a_read_only_default(
    read_only_db: str, driver: str,
) -> None:
    g = group()
    async with pgcoord.Member(read_only_db, group=g, name=f"a-{g}", driver=driver) as a, \
            pgcoord.LockHolder(a) as locks, locks.lock(a_key()):
        assert [p.name for p in await a.peers()] == [a.name]


# -- 6. pools whose idle connections the server ends ---------------------------------------


@pytest.fixture(scope="module")
def idle_db(pg_server: Server) -> Iterator[str]:
    # Above SEMAPHORE_RECHECK (0.5 s): a semaphore's waiter tries that often, so its
    # connection is never idle for longer.
    yield from _database(pg_server, {"idle_session_timeout": "1s"})


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_pools_go_on_after_the_server_ended_their_idle_connections(idle_db: str, kind: str) -> None:
    async with open_async(kind, idle_db, size=3) as pool:
        # Open every connection of the pool, then let the server end them all.
        async with pgcoord.exclusive(pool, a_key()), pgcoord.exclusive(pool, a_key()):
            pass
        await asyncio.sleep(1.6)
        async with pgcoord.exclusive(pool, a_key()) as conn:
            assert await show(conn, "transaction_read_only") == "off"
        await asyncio.sleep(1.6)
        async with pgcoord.Lease(pool, f"idle-{uuid.uuid4().hex[:8]}", ttl=5.0) as fence:
            assert fence >= 1
        await asyncio.sleep(1.6)
        async with pgcoord.semaphore(pool, f"idle-{uuid.uuid4().hex[:8]}", limit=1):
            pass
        await asyncio.sleep(1.6)
        # The scheduler's statements (registration, claim, record) on the same pool.
        ran: list[object] = []
        s = pgcoord.Scheduler(pool)
        job = f"idle-job-{uuid.uuid4().hex[:8]}"

        @s.cron(job, "0 0 1 1 *")
        async def work(slot: object) -> None:
            ran.append(slot)

        await asyncio.wait_for(s.trigger(job), 30)
        await asyncio.sleep(1.6)
        await asyncio.wait_for(s.trigger(job), 30)
        assert len(ran) == 2


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool"])
async def test_a_semaphore_wait_outlasts_idle_session_timeout(idle_db: str, kind: str) -> None:
    name = f"idle-sem-{uuid.uuid4().hex[:8]}"
    async with open_async(kind, idle_db, size=3) as pool:
        entered = asyncio.Event()

        async def first() -> None:
            async with pgcoord.semaphore(pool, name, limit=1):
                entered.set()
                await asyncio.sleep(2.5)

        task = asyncio.ensure_future(first())
        await asyncio.wait_for(entered.wait(), 10)
        started = time.monotonic()
        async with asyncio.timeout(30), pgcoord.semaphore(pool, name, limit=1):
            assert time.monotonic() - started > 1.5
        await task


async def test_a_lease_waits_for_a_fenced_transaction_past_statement_timeout(timeouts_db: str) -> None:
    name = f"lease-{uuid.uuid4().hex[:8]}"
    async with open_async("asyncpg-pool", timeouts_db, size=3) as pool:
        lease = pgcoord.Lease(pool, name, ttl=9.0)
        fence = await lease.acquire()
        conn = await asyncpg.connect(timeouts_db)
        try:
            tx = conn.transaction()
            await tx.start()
            await pgcoord.check_fence(conn, name, fence)  # the row FOR SHARE
            await lease.release()
            other = pgcoord.Lease(pool, name, ttl=9.0)
            waiting = asyncio.ensure_future(other.acquire())
            await asyncio.sleep(2.0)  # longer than statement_timeout, shorter than ttl/3
            await tx.rollback()
            assert await asyncio.wait_for(waiting, 20) > fence
            await other.release()
        finally:
            await conn.close()
