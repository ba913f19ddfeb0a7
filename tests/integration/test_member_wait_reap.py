"""A watcher's wait and reap in one statement (member_wait_reap, 0011), off the happy path:
sibling waits cut short, cancels at random, two processes killed at once, a stopped
watcher holding a share, id reuse, migrations down and up, hostile search_path."""

from __future__ import annotations

import asyncio
import os
import contextlib
import random
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

from .conftest import migrated_database, sql

NS = 1885823853


def group() -> str:
    return f"reap-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def own_db(pg_server: object) -> Iterator[str]:
    yield from migrated_database(pg_server, "pgcoord_reap")  # type: ignore[arg-type]


def reason(dsn: str, member_id: int) -> object:
    rows = sql(dsn, "select left_reason from pgcoord.member_sessions where id = %s", member_id)
    return rows[0][0] if rows else "missing"


def granted_shares(dsn: str) -> list[tuple[object, ...]]:
    return sql(dsn, "select pid, objid, mode from pg_locks where locktype = 'advisory' and classid = %s"
                    " and objsubid = 2 and granted and mode <> 'ExclusiveLock'"
                    " and database = (select oid from pg_database where datname = current_database())",
               NS)


async def until(check: object, timeout: float) -> float:
    start = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_one_session_of_a_multi_member_process_terminated(own_db: str) -> None:
    dsn = own_db
    g = group()
    async with contextlib.AsyncExitStack() as stack:
        members = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=30)) for _ in range(5)]
        await asyncio.sleep(0.5)
        ids = [m.id for m in members]
        victim = members[2]
        vid = victim.id
        sql(dsn, "select pg_terminate_backend(%s)", victim._main.backend_pid)
        took = await until(lambda: reason(dsn, vid) is not None, 3)
        await asyncio.sleep(1.0)
        others = {i: reason(dsn, i) for i in ids if i != vid}
        leftovers = granted_shares(dsn)
        print("one-session took", took)
        assert took < 1.0, took
        assert all(r is None for r in others.values()), others
        assert leftovers == [], leftovers


async def test_watchers_cancelled_at_random_leave_no_share_and_tell_every_death(own_db: str) -> None:
    dsn = own_db
    rnd = random.Random(7)
    problems = []
    for round_ in range(6):
        g = group()
        async with contextlib.AsyncExitStack() as stack:
            members = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=30)) for _ in range(6)]
            await asyncio.sleep(0.4)
            victims = rnd.sample(members[1:], 2)
            vids = [v.id for v in victims]
            watchers = [m._ring.session.backend_pid for m in members if m not in victims]
            admin = await asyncpg.connect(dsn)
            killer = await asyncpg.connect(dsn)
            try:
                async def spam() -> None:
                    end = time.monotonic() + 0.4
                    while time.monotonic() < end:
                        try:
                            await admin.execute("select pg_cancel_backend(p) from unnest($1::int[]) p", watchers)
                        except asyncpg.QueryCanceledError:
                            problems.append((round_, "admin cancelled", admin.get_server_pid(), watchers))
                        await asyncio.sleep(rnd.uniform(0.0, 0.03))

                spammer = asyncio.create_task(spam())
                await asyncio.sleep(rnd.uniform(0, 0.05))
                for v in victims:
                    await killer.execute("select pg_terminate_backend($1)", v._main.backend_pid)
                    await asyncio.sleep(0.01)
                await spammer
            finally:
                await admin.close()
                await killer.close()
            try:
                await until(lambda: all(reason(dsn, i) is not None for i in vids), 3)
            except AssertionError:
                problems.append((round_, "not told", {i: reason(dsn, i) for i in vids}))
            await asyncio.sleep(0.5)
            shares = granted_shares(dsn)
            if shares:
                problems.append((round_, "shares left", shares))
            marked = [m.id for m in members if m not in victims and reason(dsn, m.id) is not None]
            if marked:
                problems.append((round_, "live marked", marked))
    assert not problems, problems


MANY = """
import asyncio, sys
import pgcoord

async def main(dsn, group, n):
    members = [pgcoord.Member(dsn, group=group, ttl=30) for _ in range(n)]
    for m in members:
        await m.open()
    print(" ".join(f"{m.id}:{m._main.backend_pid}:{m._ring.session.backend_pid}" for m in members), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def spawn(dsn: str, g: str, n: int) -> tuple[subprocess.Popen[str], dict[int, tuple[int, int]]]:
    child = subprocess.Popen([sys.executable, "-c", MANY, dsn, g, str(n)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    ids = {int(p.split(":")[0]): (int(p.split(":")[1]), int(p.split(":")[2])) for p in line.split()}
    return child, ids


async def test_two_processes_killed_at_once(own_db: str) -> None:
    dsn = own_db
    g = group()
    async with pgcoord.Member(dsn, group=g, ttl=30) as observer:
        c1, ids1 = await asyncio.to_thread(spawn, dsn, g, int(os.environ.get('BRK_N', '4')))
        c2, ids2 = await asyncio.to_thread(spawn, dsn, g, int(os.environ.get('BRK_N', '4')))
        try:
            await asyncio.sleep(0.7)
            killed = time.monotonic()
            c1.send_signal(signal.SIGKILL)
            c2.send_signal(signal.SIGKILL)
            every = list(ids1) + list(ids2)
            try:
                await until(lambda: all(reason(dsn, i) is not None for i in every), 4)
            finally:
                state = {i: reason(dsn, i) for i in every}
            took = time.monotonic() - killed
            print("two-process took", took)
            await asyncio.sleep(0.5)
            assert granted_shares(dsn) == []
            assert observer.id is not None and reason(dsn, observer.id) is None
            assert took < 2.0, (took, state)
        finally:
            for c in (c1, c2):
                c.kill()
                c.wait()


async def test_stopped_watcher_holding_a_share_does_not_hold_up_others(own_db: str) -> None:
    # Process P (stopped) watches member X of process Q; X dies; P's watcher is
    # granted a share of X and reaps, then stays stopped holding it. Then X's id
    # neighbour dies as well: everyone else must still be told.
    dsn = own_db
    g = group()
    async with contextlib.AsyncExitStack() as stack:
        mine = [await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=30)) for _ in range(2)]
        cp, idsp = await asyncio.to_thread(spawn, dsn, g, 2)
        cq, idsq = await asyncio.to_thread(spawn, dsn, g, 2)
        try:
            await asyncio.sleep(0.7)
            cp.send_signal(signal.SIGSTOP)
            cq.send_signal(signal.SIGKILL)
            await until(lambda: all(reason(dsn, i) is not None for i in idsq), 3)
            await asyncio.sleep(0.3)
            # Now one of our own members' session ends.
            vid = mine[1].id
            sql(dsn, "select pg_terminate_backend(%s)", mine[1]._main.backend_pid)
            took = await until(lambda: reason(dsn, vid) is not None, 3)
            assert took < 1.0, took
        finally:
            cp.send_signal(signal.SIGCONT)
            for c in (cp, cq):
                c.kill()
                c.wait()


async def test_join_on_a_reused_id_while_a_watcher_holds_its_share(own_db: str) -> None:
    dsn = own_db
    g = group()
    async with pgcoord.Member(dsn, group=g, ttl=30) as a:
        nxt = int(sql(dsn, "select last_value from pgcoord.member_ids")[0][0]) + 1
        holder = await asyncpg.connect(dsn)
        try:
            # a stopped watcher granted a share of the dead member whose id comes next
            await holder.execute("select pg_advisory_lock_shared($1, $2)", NS, nxt)
            start = time.monotonic()
            try:
                b = pgcoord.Member(dsn, group=g, ttl=30)
                await asyncio.wait_for(b.open(), 5)
                took = time.monotonic() - start
                got = b.id
                await b.close()
            except Exception as exc:  # noqa: BLE001
                took, got = time.monotonic() - start, repr(exc)
        finally:
            await holder.close()
        print("reuse", took, got, nxt)
        assert took < 2.0 and got != nxt, (took, got, nxt)


def test_migrate_down_to_0010_and_up_again(own_db: str) -> None:
    pgcoord.migrations.downgrade(own_db, "0010")
    cols = sql(own_db, "select column_name from information_schema.columns where table_schema='pgcoord'"
                       " and table_name='member_sessions' and column_name='client'")
    assert cols == []
    pgcoord.migrations.upgrade(own_db)
    cols = sql(own_db, "select column_name from information_schema.columns where table_schema='pgcoord'"
                       " and table_name='member_sessions' and column_name='client'")
    assert cols == [("client",)]


def test_member_join_from_under_a_hostile_search_path(own_db: str) -> None:
    role = f"hostile_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(own_db, autocommit=True) as conn:
        conn.execute(f"create role {role} login")
        conn.execute(f"grant pgcoord_member to {role}") if conn.execute(
            "select 1 from pg_roles where rolname='pgcoord_member'").fetchone() else None
        conn.execute(f"grant all on schema pgcoord to {role}")
        conn.execute(f"grant all on all tables in schema pgcoord to {role}")
        conn.execute(f"grant all on all sequences in schema pgcoord to {role}")
        conn.execute(f"create schema {role} authorization {role}")
        conn.execute(f"alter role {role} set search_path = {role}, pgcoord, public")
    hdsn = own_db.replace("postgres@", f"{role}@", 1)
    with psycopg.connect(hdsn, autocommit=True) as conn:
        # shadow functions/operators that an unpinned body would pick up
        conn.execute(f"create function {role}.nextval(regclass) returns bigint language sql as 'select 424242::bigint'")
        conn.execute(f"create function {role}.pg_backend_pid() returns integer language sql as 'select 1'")
        conn.execute(f"create table {role}.member_sessions (id int, client text)")
        row = conn.execute("select id from pgcoord.member_join_from('g-hostile','n',NULL,30000,'app',true,'h:1')"
                           ).fetchone()
        assert row is not None
        got = sql(own_db, "select client, pid <> 1 from pgcoord.member_sessions where id = %s", row[0])
        assert got == [("h:1", True)], got
        assert row[0] != 424242


STEPPED = """
import asyncio, sys
import pgcoord

async def main(dsn, group, n):
    members = []
    for _ in range(n):
        await asyncio.to_thread(sys.stdin.readline)
        m = pgcoord.Member(dsn, group=group, ttl=30)
        await m.open()
        members.append(m)
        print(m.id, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def test_a_crashed_process_s_members_are_told_crashed_to_every_watching_member(own_db: str) -> None:
    dsn = own_db
    g = group()
    n = 3
    child = subprocess.Popen([sys.executable, "-c", STEPPED, dsn, g, str(n)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        async with contextlib.AsyncExitStack() as stack:
            observers: list[pgcoord.Member] = []
            theirs: list[int] = []
            for _ in range(n):
                observers.append(await stack.enter_async_context(pgcoord.Member(dsn, group=g, ttl=30)))
                child.stdin.write("\n")
                child.stdin.flush()
                theirs.append(int(await asyncio.to_thread(child.stdout.readline)))
            streams = [o.watch() for o in observers]
            seen: dict[int, dict[int, str]] = {o.id: {} for o in observers}

            async def collect(o: pgcoord.Member, stream: object) -> None:
                async for change in stream:  # type: ignore[attr-defined]
                    if isinstance(change, pgcoord.MemberLeft) and change.member.id in theirs:
                        seen[o.id][change.member.id] = change.reason

            tasks = [asyncio.create_task(collect(o, s)) for o, s in zip(observers, streams)]
            await asyncio.sleep(1.0)
            ring_targets = {o.id: o._ring._target for o in observers}
            child.send_signal(signal.SIGKILL)
            try:
                await until(lambda: all(len(v) == n for v in seen.values()), 5)
            finally:
                for t in tasks:
                    t.cancel()
            rows = sql(dsn, "select id, left_reason from pgcoord.member_sessions where id = any(%s)", theirs)
            assert all(r == "crashed" for _, r in rows), rows
            wrong = {o: {i: r for i, r in v.items() if r != "crashed"} for o, v in seen.items()}
            assert not any(wrong.values()), (wrong, ring_targets, theirs)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("how", ["control", "joiner_poke", "cancel", "cancel_listening"])
async def test_a_death_whose_watcher_is_cut_during_the_sibling_wait_is_still_told(
        own_db: str, how: str) -> None:
    # A (this process) watches T; T and S live in another process, which is stopped
    # (its sessions live on). Only T's session ends: A's watcher is granted T and then
    # waits (50 ms) for S. A joiner in front of S pokes whoever waits for S's alive
    # lock (member_poke_predecessor) -- A's watcher among them -- or an operator
    # cancels A's watcher. T's death must still be told at once.
    from pgcoord._core.queries import query

    dsn = own_db
    g = group()
    child = subprocess.Popen([sys.executable, "-c", STEPPED, dsn, g, "2"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        async with pgcoord.Member(dsn, group=g, ttl=30) as a:
            child.stdin.write("\n")
            child.stdin.flush()
            t = int(await asyncio.to_thread(child.stdout.readline))
            sql(dsn, "select setval('pgcoord.member_ids', %s)", t + 10)
            child.stdin.write("\n")
            child.stdin.flush()
            s = int(await asyncio.to_thread(child.stdout.readline))
            if how == "cancel_listening":
                stream = a.watch()  # noqa: F841  (A listens to membership news)
            await asyncio.sleep(1.0)
            assert a._ring._target == t
            t_pid = sql(dsn, "select pid from pgcoord.member_sessions where id = %s", t)[0][0]
            child.send_signal(signal.SIGSTOP)
            await asyncio.sleep(0.2)
            admin = await asyncpg.connect(dsn)
            try:
                await admin.execute("select pg_terminate_backend($1)", t_pid)
                killed = time.monotonic()
                # A's watcher is in its sibling wait now (granted T, waiting on S).
                for _ in range(100):
                    waiting = await admin.fetchval(
                        "select count(*) from pg_locks where locktype='advisory' and classid=$1"
                        " and objid=$2 and not granted and pid=$3", NS, s, a._ring.session.backend_pid)
                    if waiting:
                        break
                    await asyncio.sleep(0.002)
                cut = None
                if how == "joiner_poke":
                    cut = await admin.fetchval(query("member_poke_predecessor"), s)
                elif how.startswith("cancel"):
                    cut = await admin.fetchval("select pg_cancel_backend($1)", a._ring.session.backend_pid)
            finally:
                await admin.close()
            try:
                await until(lambda: reason(dsn, t) is not None, float(os.environ.get("BRK_WAIT", "5")))
            except AssertionError:
                pass
            took = time.monotonic() - killed
            assert took < 1.0, repr((took, reason(dsn, t), "waiting seen:", waiting, "cut:", cut,
                                "A now watches", a._ring._target, "ring", a._ring.ids, "t,s =", t, s))
    finally:
        child.send_signal(signal.SIGCONT)
        child.kill()
        child.wait()


def test_sibling_wait_leaves_no_lock_timeout_and_no_xact_lock(own_db: str) -> None:
    dsn = own_db
    g = group()
    with psycopg.connect(dsn, autocommit=True) as holder, psycopg.connect(dsn, autocommit=True) as w:
        hpid = holder.execute("select pg_backend_pid()").fetchone()[0]
        holder.execute("select pg_advisory_lock(%s, 900002)", (NS,))
        for i, pid in ((900001, 1), (900002, hpid)):
            holder.execute("insert into pgcoord.member_sessions (id, \"group\", name, meta, pid, application_name,"
                           " ttl_ms, has_session, client) values (%s, %s, %s, '{}', %s, 'x', 30000, true, 'h:1')",
                           (i, g, f"n{i}", pid))
        w.execute("set lock_timeout = '123ms'")
        w.execute("begin")
        t0 = time.monotonic()
        out = w.execute("select pgcoord.member_wait_reap(900001)").fetchone()[0]
        took = time.monotonic() - t0
        inside = w.execute("show lock_timeout").fetchone()[0]
        w.execute("commit")
        after = w.execute("show lock_timeout").fetchone()[0]
        locks = sql(dsn, "select objid, mode, granted from pg_locks where locktype='advisory' and pid = %s",
                    w.info.backend_pid)
        print("took", took, out, inside, after, locks)
        assert inside == "123ms" and after == "123ms", (inside, after)
        assert locks == [(900001, "ShareLock", True)], locks


async def test_a_service_role_with_a_hostile_search_path_tells_a_sibling_death(own_db: str) -> None:
    from pgcoord._core.resources import read_sql

    role = f"svc_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(own_db, autocommit=True) as admin:
        admin.execute(f"create role {role} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", role)
                      .replace("pgcoord_operator", f"ops_{role}") if False else
                      "\n".join(l for l in read_sql("roles.sql").replace("pgcoord_service", role).splitlines()
                                if "pgcoord_operator" not in l))
        admin.execute(f"create schema {role} authorization {role}")
        admin.execute(f"alter role {role} set search_path = {role}, public, pgcoord")
    sdsn = own_db.replace("postgres@", f"{role}@", 1)
    with psycopg.connect(sdsn, autocommit=True) as conn:
        conn.execute(f"create table {role}.member_sessions (id int, client text, left_at timestamptz)")
        conn.execute(f"create function {role}.clock_timestamp() returns timestamptz language sql"
                     " as $$ select now() - interval '1 day' $$")
    g = group()
    async with contextlib.AsyncExitStack() as stack:
        members = [await stack.enter_async_context(pgcoord.Member(sdsn, group=g, ttl=30)) for _ in range(3)]
        await asyncio.sleep(0.5)
        clients = sql(own_db, "select client from pgcoord.member_sessions where id = any(%s)",
                      [m.id for m in members])
        assert len({c for (c,) in clients}) == 1 and clients[0][0] is not None, clients
        vid = members[1].id
        sql(own_db, "select pg_terminate_backend(%s)", members[1]._main.backend_pid)
        took = await until(lambda: reason(own_db, vid) is not None, 3)
        assert reason(own_db, vid) == "crashed" and took < 1.0, (reason(own_db, vid), took)
