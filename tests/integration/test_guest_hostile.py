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

from .conftest import Server, migrated_database, sql

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


async def no_advisory_locks(dsn: str, within: float = 5.0, *, apps: str = "%") -> None:
    """Every advisory lock in ``dsn``'s database (of sessions whose application_name is
    LIKE ``apps``) is gone: a closed session's backend takes a moment to end after its
    client has gone."""
    query = ("select l.pid, a.application_name from pg_locks as l "
             "left join pg_stat_activity as a using (pid) where l.locktype = 'advisory' "
             "and l.pid <> pg_backend_pid() and coalesce(a.application_name, '') like %s "
             "and l.database = (select oid from pg_database where datname = current_database())")
    deadline = time.monotonic() + within
    while (left := sql(dsn, query, apps)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert left == []


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
    yield from migrated_database(pg_server, "pgcoord_guest", settings)


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
        await no_advisory_locks(tx_timeout_db)


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
        await asyncio.sleep(1.0)  # the pool's one connection is ended before the holder borrows it
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
        await asyncio.sleep(1.0)
        async with pgcoord.exclusive(pool, a_key()) as conn:
            after = [await show(conn, n) for n in ("idle_session_timeout", "lock_timeout",
                                                   "search_path", "application_name")]
        assert after == before
        await no_advisory_locks(idle_db)


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
    await no_advisory_locks(plain_db_of(dsn))


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
    await no_advisory_locks(plain_db)


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


# -- a member-bound election under an operator's cancels and terminations ------------------


def watcher_pid(dsn: str, name: str) -> int | None:
    rows = sql(dsn, "select pid from pg_stat_activity where application_name = %s",
               f"pgcoord-member:{name}/watch")
    return int(rows[0][0]) if rows else None  # type: ignore[call-overload]


def candidacy_holders(dsn: str, lease: str) -> list[int]:
    """The sessions holding ``lease``'s candidacy lock (see pgcoord/member/ring.py)."""
    from pgcoord.member.ring import candidacy_key

    key = candidacy_key(lease)
    return [int(r[0]) for r in sql(  # type: ignore[call-overload]
        dsn, "select pid from pg_locks where locktype = 'advisory' and objsubid = 1 and granted "
             "and ((classid::bigint << 32) | objid::bigint) = %s", key)]


async def test_a_standing_follower_keeps_its_place_through_cancels_and_a_new_watcher(dsn: str) -> None:
    """Operators cancel and terminate what look like long waits: the follower's and the
    leader's watchers (the follower's holds its candidacy), the main sessions' idle
    moments. Nobody's id changes, the term stays, the follower stands again on its new
    watcher, and takes over a released lease at once (ttl/3 is 10 s: only a poke is
    this quick)."""
    name, g = f"guest-el:{uuid.uuid4().hex[:6]}", group()
    terms: list[tuple[str, int, float]] = []

    def lead_as(who: str) -> object:
        async def lead(fence: int) -> None:
            terms.append((who, fence, time.monotonic()))
            await asyncio.sleep(3600)
        return lead

    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", ttl=30) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", ttl=30) as b:
        members = {"a": a, "b": b}
        electors = {who: pgcoord.Elector(m, name, ttl=30) for who, m in members.items()}
        tasks = [asyncio.ensure_future(electors["a"].run(lead_as("a")))]  # type: ignore[arg-type]
        try:
            await wait_for(lambda: len(terms) == 1, 10)
            tasks.append(asyncio.ensure_future(electors["b"].run(lead_as("b"))))  # type: ignore[arg-type]
            await wait_for(lambda: watcher_pid(dsn, b.name) in candidacy_holders(dsn, name), 10)
            ids = (a.id, b.id)
            for _ in range(3):
                for m in (a, b):
                    sql(dsn, "select pg_cancel_backend(%s)", watcher_pid(dsn, m.name))
                    sql(dsn, "select pg_cancel_backend(%s)", main_pid(m))
                    await asyncio.sleep(0.05)
            for m in (b, a):
                old = watcher_pid(dsn, m.name)
                sql(dsn, "select pg_terminate_backend(%s)", old)
                await wait_for(lambda m=m, old=old: watcher_pid(dsn, m.name) not in (None, old), 15)
            await wait_for(lambda: watcher_pid(dsn, b.name) in candidacy_holders(dsn, name), 10)
            await asyncio.sleep(0.5)
            assert (a.id, b.id) == ids
            assert [t[:2] for t in terms] == [("a", terms[0][1])]
            stopped = time.monotonic()
            await electors["a"].stop()
            await wait_for(lambda: len(terms) == 2, 5)
            assert terms[1][:2] == ("b", terms[0][1] + 1)
            assert terms[1][2] - stopped < 2.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    await no_advisory_locks(dsn, apps=f"%{g}%")  # the suite's shared database: ours only


# -- neighbours in the ring killed together ------------------------------------------------

REPLICA = str(__import__("pathlib").Path(__file__).with_name("member_replica.py"))


def test_two_neighbours_in_the_ring_killed_at_once_are_told_crashed_to_every_survivor(plain_db: str) -> None:
    import signal
    import subprocess
    import sys

    dsn = plain_db

    async def scenario() -> None:
        g = group()
        seen: list[object] = []
        # ttl 30: the heartbeat sweep would take 10 s; only the watcher ring is quick.
        async with pgcoord.Member(dsn, group=g, name=f"obs-{g}", ttl=30) as obs:
            task = asyncio.ensure_future(collect(obs.watch(), seen))
            procs = []
            try:
                for who in ("r1", "r2", "r3"):
                    p = subprocess.Popen([sys.executable, REPLICA, dsn, g, f"{who}-{g}", "30", "asyncpg"],
                                         stdout=subprocess.PIPE, text=True)
                    procs.append(p)
                    assert p.stdout is not None
                    line = await asyncio.to_thread(p.stdout.readline)
                    assert line.startswith("JOINED"), line
                ids = sorted(int(r[0]) for r in sql(dsn, "select id from pgcoord.members"))  # type: ignore[call-overload]
                assert len(ids) == 4 and ids[0] == obs.id  # obs, r1, r2, r3 in ring order
                await wait_for(lambda: sum(1 for c in seen if isinstance(c, pgcoord.MemberJoined)) == 3, 10)
                await asyncio.sleep(0.5)  # every watcher waits on its successor
                own = obs.id
                for p in procs[:2]:
                    p.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                await wait_for(lambda: len(departures(seen)) == 2, 5)
                assert time.monotonic() - killed < 3.0
                assert sorted((c.member.name, c.reason) for c in departures(seen)) == [  # type: ignore[attr-defined]
                    (f"r1-{g}", "crashed"), (f"r2-{g}", "crashed")]
                # The survivor outside this process was told the same, once each.
                survivor = procs[2]
                assert survivor.stdout is not None
                lines = [await asyncio.wait_for(asyncio.to_thread(survivor.stdout.readline), 5) for _ in range(2)]
                assert sorted(line.split()[1:3] for line in lines) == [[f"r1-{g}", "crashed"], [f"r2-{g}", "crashed"]]
                assert obs.id == own
                # obs now watches r3, and r3 watches obs.
                await wait_for(lambda: obs._ring._target == ids[3], 5)
                survivor.send_signal(signal.SIGKILL)
                await wait_for(lambda: len(departures(seen)) == 3, 5)
                await asyncio.sleep(0.3)
                assert len(departures(seen)) == 3 and obs.id == own
            finally:
                task.cancel()
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
        await no_advisory_locks(dsn)

    asyncio.run(scenario())


# -- an operator cancels an Elector(dsn) follower's doorbell wait -------------------------


def elector_sessions(dsn: str, name: str) -> set[int]:
    return {int(r[0]) for r in sql(dsn, "select pid from pg_stat_activity "  # type: ignore[call-overload]
                                        "where application_name = %s", f"pgcoord-elector:{name}")}


async def test_an_operators_cancel_of_a_followers_doorbell_wait_keeps_its_session(plain_db: str) -> None:
    """pg_cancel_backend on what looks like a long-waiting query (the follower's
    doorbell wait) cuts that one statement: the follower waits again on the same
    session, holds no doorbell level it did not mean to, and still takes over at once
    when the leader's session ends."""
    dsn, name = plain_db, f"el-{uuid.uuid4().hex[:8]}"
    terms: list[tuple[str, int]] = []

    def lead_as(who: str) -> object:
        async def lead(fence: int) -> None:
            terms.append((who, fence))
            await asyncio.Event().wait()
        return lead

    leader = pgcoord.Elector(dsn, name, holder="leader", ttl=30)
    follower = pgcoord.Elector(dsn, name, holder="follower", ttl=30)
    tasks = [asyncio.ensure_future(leader.run(lead_as("leader")))]  # type: ignore[arg-type]
    try:
        await wait_for(lambda: terms == [("leader", terms[0][1])] if terms else False, 15)
        tasks.append(asyncio.ensure_future(follower.run(lead_as("follower"))))  # type: ignore[arg-type]
        waiting = lambda: sql(dsn, "select pid from pg_stat_activity where application_name = %s "  # noqa: E731
                                   "and wait_event_type = 'Lock'", f"pgcoord-elector:{name}")
        await wait_for(lambda: len(waiting()) == 1, 15)
        sessions = elector_sessions(dsn, name)
        (follower_pid,) = waiting()[0]
        for _ in range(3):
            sql(dsn, "select pg_cancel_backend(%s)", follower_pid)
            await wait_for(lambda: len(waiting()) == 1, 5)
        await asyncio.sleep(0.3)
        assert elector_sessions(dsn, name) == sessions
        assert terms == [("leader", terms[0][1])]
        # The leader's session ends: the follower, waiting on the doorbell, leads at once.
        (leader_pid,) = sessions - {follower_pid}
        started = time.monotonic()
        sql(dsn, "select pg_terminate_backend(%s)", leader_pid)
        await wait_for(lambda: any(who == "follower" for who, _ in terms), 5)
        assert time.monotonic() - started < 2.0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.2)
    await no_advisory_locks(dsn)


# -- a connection goes back exactly as it came ---------------------------------------------


@pytest.fixture(scope="module")
def tuned_role(plain_db: str) -> Iterator[str]:
    """A role carrying a DBA's settings: pgcoord must undo whatever it changes on them."""
    role = f"pgcoord_tuned_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(plain_db, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN SUPERUSER")
        for name, value in {"lock_timeout": "4s", "statement_timeout": "20s",
                            "idle_in_transaction_session_timeout": "20s", "idle_session_timeout": "60s",
                            "default_transaction_isolation": "repeatable read",
                            "search_path": "public", "application_name": "dba-app",
                            "tcp_keepalives_idle": "77"}.items():
            conn.execute(f"ALTER ROLE {role} SET {name} = '{value}'")
    try:
        yield plain_db.replace("postgres@", f"{role}@", 1)
    finally:
        with psycopg.connect(plain_db, autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where usename = %s", (role,))
            conn.execute(f"DROP ROLE {role}")


async def all_settings(conn: psycopg.AsyncConnection) -> dict[str, tuple[str, str]]:
    cur = await conn.execute("select name, setting, source from pg_settings "
                             "where name not in ('transaction_isolation', 'transaction_read_only') "
                             "and name not like 'plpgsql.%'")  # loaded with the language, harmless
    return {str(n): (str(s), str(src)) for n, s, src in await cur.fetchall()}


async def test_every_feature_gives_a_connection_back_as_it_came(tuned_role: str) -> None:
    """On a psycopg pool (which, unlike asyncpg's, resets nothing on give-back), every
    setting, and where it came from, is what it was before pgcoord used the connection."""
    import psycopg_pool

    dsn, tag = tuned_role, uuid.uuid4().hex[:8]
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as one, \
            psycopg_pool.AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False) as two:
        async with one.connection() as conn:
            before = await all_settings(conn)
        async with two.connection() as conn:
            assert await all_settings(conn) == before

        async with pgcoord.exclusive(one, a_key()):
            pass
        async with pgcoord.exclusive(one, a_key(), timeout=2.0):
            pass
        async with pgcoord.semaphore(one, f"sem-{tag}", limit=1):
            pass
        async with pgcoord.LockHolder(one) as locks:
            async with locks.lock(f"held-{tag}"):
                pass
            async with locks.lock(f"held2-{tag}", timeout=2.0):
                pass
            async with locks.semaphore(f"hsem-{tag}", limit=1):
                pass
        async with one.connection() as conn:
            assert await all_settings(conn) == before
            async with conn.transaction():  # nothing left for the next transaction either
                assert await all_settings(conn) == before

        async with pgcoord.Lease(two, f"lease-{tag}", ttl=3.0):
            await asyncio.sleep(1.2)  # one renewal
        s = pgcoord.Scheduler(two)

        @s.cron(f"job-{tag}", "0 0 1 1 *")
        async def work(slot: object) -> None:
            pass

        await asyncio.wait_for(s.trigger(f"job-{tag}"), 30)
        for _ in range(2):
            async with two.connection() as conn:
                assert await all_settings(conn) == before



@pytest.mark.parametrize("kind", ["sa-async-asyncpg", "sa-async-psycopg"])
async def test_sqlalchemy_engines_go_on_after_the_server_ended_their_idle_connections(
    idle_db: str, kind: str,
) -> None:
    from .sources import open_async

    async with open_async(kind, idle_db, size=2) as engine:
        async with pgcoord.exclusive(engine, a_key()), pgcoord.exclusive(engine, a_key()):
            pass
        await asyncio.sleep(1.0)
        async with pgcoord.exclusive(engine, a_key()):
            pass
        await asyncio.sleep(1.0)
        async with pgcoord.semaphore(engine, f"idle-{uuid.uuid4().hex[:8]}", limit=1):
            pass
        await asyncio.sleep(1.0)
        async with pgcoord.Lease(engine, f"idle-{uuid.uuid4().hex[:8]}", ttl=3.0) as fence:
            assert fence >= 1
            await asyncio.sleep(2.5)  # renewals after the connections were ended
        await asyncio.sleep(1.0)
        async with pgcoord.LockHolder(engine) as locks, locks.lock(a_key()):
            pass


# -- default_transaction_read_only on for a while, then off ----------------------------------


@pytest.fixture
def own_db(pg_server: Server) -> Iterator[str]:
    yield from _database(pg_server, {})


async def test_a_scheduler_and_leases_go_on_after_a_read_only_spell(own_db: str) -> None:
    """The DBA sets default_transaction_read_only for the database (a maintenance
    window, a promotion gone wrong) and the pool's connections are renewed under it,
    then takes it back. While it lasts pgcoord's writes are refused with a named
    error; afterwards the scheduler runs its slots again, and a lease is had, without
    anything restarted."""
    from .sources import APP, open_async

    dsn, tag = own_db, uuid.uuid4().hex[:8]
    dbname = dsn.rsplit("/", 1)[1]

    def renew_pool_connections() -> None:
        sql(dsn, "select pg_terminate_backend(pid) from pg_stat_activity "
                 "where application_name = %s and datname = current_database()", APP)

    ran: list[float] = []
    async with open_async("asyncpg-pool", dsn, size=4) as pool:
        s = pgcoord.Scheduler(pool)

        @s.cron(f"every-second-{tag}", "* * * * * *")
        async def work(slot: object) -> None:
            ran.append(time.monotonic())

        runner = asyncio.ensure_future(s.run())
        try:
            await wait_for(lambda: len(ran) >= 2, 20)
            sql(dsn, f"alter database {dbname} set default_transaction_read_only = on")
            renew_pool_connections()
            await asyncio.sleep(0.5)
            with pytest.raises(pgcoord.PgcoordError, match="default_transaction_read_only"):
                async with asyncio.timeout(20):
                    await pgcoord.Lease(pool, f"ro-{tag}", ttl=3.0).acquire()
            await asyncio.sleep(2.0)
            with psycopg.connect(dsn, autocommit=True, options="-c default_transaction_read_only=off") as conn:
                conn.execute(f"alter database {dbname} reset default_transaction_read_only")
            renew_pool_connections()
            back = time.monotonic()
            await wait_for(lambda: any(t > back for t in ran), 15)
            assert not runner.done()
            async with asyncio.timeout(20), pgcoord.Lease(pool, f"ro-{tag}", ttl=3.0) as fence:
                assert fence >= 1
        finally:
            await s.stop()
            await asyncio.gather(runner, return_exceptions=True)


# -- a migration (or an operator) locks pgcoord's member table for a while ------------------


@pytest.mark.parametrize("driver", DRIVERS)
async def test_members_ride_out_their_table_locked_by_a_migration(plain_db: str, driver: str) -> None:
    """An ALTER TABLE on pgcoord.member_sessions (a later ``pgcoord migrate``, a VACUUM
    FULL) holds its ACCESS EXCLUSIVE lock for a few seconds while the fleet runs:
    every statement of the members on it is cut by their 500 ms lock_timeout, again
    and again. Their sessions live: nobody's id changes, nobody is told anyone left,
    and a member that joins meanwhile joins once the table is free."""
    dsn, g = plain_db, group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", ttl=1.5, driver=driver) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", ttl=1.5, driver=driver) as b:
        seen: list[object] = []
        task = asyncio.ensure_future(collect(b.watch(), seen))
        try:
            await asyncio.sleep(0.3)
            ids = (a.id, b.id)
            blocker = await asyncpg.connect(dsn)
            try:
                tx = blocker.transaction()
                await tx.start()
                await blocker.execute("lock table pgcoord.member_sessions in access exclusive mode")
                c = pgcoord.Member(dsn, group=g, name=f"c-{g}", ttl=1.5, driver=driver)
                joining = asyncio.ensure_future(c.open())
                await asyncio.sleep(2.5)
                await tx.commit()
            finally:
                await blocker.close()
            try:
                await asyncio.wait_for(joining, 15)
                await wait_for(lambda: [x.member.name for x in seen  # type: ignore[attr-defined]
                                        if isinstance(x, pgcoord.MemberJoined)] == [c.name], 10)
                await asyncio.sleep(1.0)
                assert (a.id, b.id) == ids
                assert departures(seen) == []
                assert a.has_session and b.has_session and c.has_session
            finally:
                await c.close()
            await wait_for(lambda: [(x.member.name, x.reason) for x in departures(seen)]  # type: ignore[attr-defined]
                           == [(c.name, "left")], 10)
        finally:
            task.cancel()


# -- a stand taken while the watcher is between statements ---------------------------------


async def test_every_stand_is_taken_at_once_even_when_the_watcher_is_between_statements(plain_db: str) -> None:
    """A feature stands for a lease (its member's watcher must hold the candidacy
    lock, or the lease's release pokes nobody); the watcher is told by a cancel of its
    wait. Stands and withdrawals in quick succession land while the watcher is
    between two statements, where a cancel is lost: each stand must still be held at
    once, not at the next ring change (ttl 30: the heartbeat would take 10 s)."""
    dsn, g = plain_db, group()
    async with pgcoord.Member(dsn, group=g, name=f"a-{g}", ttl=30) as a, \
            pgcoord.Member(dsn, group=g, name=f"b-{g}", ttl=30):
        await wait_for(lambda: a._ring._target is not None, 10)
        leases = [f"lease-{uuid.uuid4().hex[:8]}" for _ in range(40)]
        for i, lease in enumerate(leases):
            withdraw = a.stand(lease, lambda: None)
            if i % 2:
                await asyncio.sleep(0.002 * (i % 7))  # land anywhere in the watcher's round
            try:
                await wait_for(lambda lease=lease: watcher_pid(dsn, a.name) in candidacy_holders(dsn, lease), 3)
            finally:
                withdraw()
        await wait_for(lambda: all(candidacy_holders(dsn, lease) == [] for lease in leases[-3:]), 3)


# -- the leader and the next follower killed together ------------------------------------

ELECTOR_REPLICA = str(__import__("pathlib").Path(__file__).with_name("elector_member_replica.py"))


def test_the_leader_and_a_standing_follower_killed_together_hand_over_at_once(plain_db: str) -> None:
    """Two processes SIGKILLed at once, next to each other in the ring: the leader's
    member and a follower's member, which stood for the lease. The last follower leads
    under the next fence, at once (ttl 30: a third of it is 10 s)."""
    import signal
    import subprocess
    import sys

    dsn, prefix = plain_db, f"pair-{uuid.uuid4().hex[:6]}"
    procs: list[subprocess.Popen[str]] = []
    try:
        for label in ("p1", "p2", "p3"):
            p = subprocess.Popen([sys.executable, ELECTOR_REPLICA, dsn, prefix, "1", label],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            if label == "p1":
                assert p.stdout is not None
                line = p.stdout.readline()
                assert line.startswith("LEAD 0"), line
                fence = int(line.split()[3])
        deadline = time.monotonic() + 15
        while len(sql(dsn, "select 1 from pgcoord.members where name in ('p2', 'p3') "
                           "and \"group\" = %s", f"{prefix}:group")) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # both followers stand on their watchers
        for p in procs[:2]:
            p.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        last = procs[2]
        assert last.stdout is not None
        line = last.stdout.readline()
        assert line.startswith("LEAD 0"), line
        assert int(line.split()[3]) == fence + 1
        assert time.monotonic() - killed < 3.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
