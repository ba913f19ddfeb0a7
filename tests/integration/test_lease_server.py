"""Migration 0007: a lease's session is judged on the server incarnation it lived on.

The failover itself is in test_ha_vanished; these tests pin what 0007 does on one
server: who may read the view, rows written before it, a session "elsewhere", the
trigger on every statement that names a session, and the way down.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import psycopg

import pgcoord
import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer
from pgcoord._core.queries import query
from pgcoord._core.resources import read_sql

from .conftest import Server, sql, unique


async def _until(predicate: object, within: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _doorbell_session(dsn: str, name: str) -> psycopg.Connection[tuple[object, ...]]:
    """A session that rang the lease's doorbell, as an elector's leader does."""
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("select pg_advisory_lock(pgcoord.lease_doorbell_key(%s))", (name,))
    return conn


def test_operator_reads_holders_while_an_elector_leads(pg_server: Server, fresh_db: str) -> None:
    """The operator role is granted the view only; a held session-bound lease must not
    make the view read pgcoord.leases with the operator's privileges."""
    pgcoord.migrations.upgrade(fresh_db)
    operator = f"ops_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {operator} login")
        admin.execute(_operator_grants(operator))
    name = unique("ops-elector")

    async def lead_and_read() -> list[tuple[object, ...]]:
        elector = pgcoord.Elector(fresh_db, name, ttl=5.0, holder="leader-1")
        told = asyncio.Event()

        async def lead(_: object) -> None:
            await told.wait()

        task = asyncio.create_task(elector.run(lead))
        try:
            await _until(lambda: elector.is_leader, 10)
            base = fresh_db.replace("postgres@", f"{operator}@")
            with psycopg.connect(base) as ops:
                return ops.execute(
                    "select holder, session_alive from pgcoord.holders"
                    " where kind = 'lease' and name = %s", (name,)).fetchall()
        finally:
            told.set()
            await elector.stop()
            await task

    try:
        rows = asyncio.run(lead_and_read())
        assert rows == [("leader-1", True)]
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename = '{operator}'")
            admin.execute(f"drop owned by {operator}; drop role {operator}")


def _operator_grants(operator: str) -> str:
    """roles.sql's operator part only, for a role of this test's own."""
    text = read_sql("roles.sql")
    return "\n".join(line.replace("pgcoord_operator", operator) for line in text.splitlines()
                     if "pgcoord_operator" in line and "pgcoord_service" not in line)


def test_rows_written_before_0007_name_this_server_once_upgraded(fresh_db: str) -> None:
    """A lease taken at 0006 and only renewed since (renewals never write holder_pid)
    is stamped with this server's incarnation by the upgrade itself."""
    pgcoord.migrations.upgrade(fresh_db, "0006")
    name = unique("before-0007")
    holder = _doorbell_session(fresh_db, name)
    try:
        holder.execute("select pgcoord.lease_acquire(%s, 'old', 60000, pg_backend_pid())", (name,))
        pgcoord.migrations.upgrade(fresh_db)
        [(stamped, here)] = sql(fresh_db, "select holder_server, pgcoord.server_incarnation()"
                                          " from pgcoord.leases where name = %s", name)
        assert stamped is not None and stamped == here
        # still judged by its doorbell: refused while held, taken once the session ends
        assert sql(fresh_db, "select * from pgcoord.lease_acquire(%s, 'new', 60000, null)", name) == []
    finally:
        holder.close()
    [(fence, _)] = sql(fresh_db, "select * from pgcoord.lease_acquire(%s, 'new', 60000, null)", name)
    assert fence == 2


def test_a_session_on_another_incarnation_waits_out_the_ttl_and_shows_unknown(dsn: str) -> None:
    """As after a failover: the row names a session of another server. Its pid may
    belong to an unrelated session here; neither lease_acquire nor partition_claim
    takes it before it expires, and the view says neither alive nor dead."""
    name = unique("elsewhere")
    part = unique("elsewhere-parts")
    bystander = psycopg.connect(dsn, autocommit=True)
    try:
        bystander.execute("set application_name = 'unrelated-bystander'")
        pid = bystander.info.backend_pid
        for lease in (name, f"{part}/0"):
            sql(dsn, "insert into pgcoord.leases (name, holder, fence, acquired_at, renewed_at,"
                     " expires_at, holder_pid) values (%s, 'old-leader', 7, now(), now(),"
                     " now() + interval '60 seconds', %s)", lease, pid)
            sql(dsn, "update pgcoord.leases set holder_server = 'another/00000009' where name = %s",
                lease)
        assert sql(dsn, "select * from pgcoord.lease_acquire(%s, 'new', 60000, null)", name) == []
        with psycopg.connect(dsn, autocommit=True) as taker:
            claimed = taker.execute(query("partition_claim").replace("$1", "%s").replace(
                "$2", "%s").replace("$3", "%s").replace("$4", "%s"),
                (part, [0], "new", 60000)).fetchone()
        assert claimed is not None and json.loads(claimed[0])[0] == []
        rows = sql(dsn, "select holder, session_alive, application_name from pgcoord.holders"
                        " where kind = 'lease' and name = %s", name)
        assert rows == [("old-leader", None, None)]
        # once expired, it is free
        sql(dsn, "update pgcoord.leases set expires_at = now() where name = %s", name)
        [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'new', 60000, null)", name)
        assert fence == 8
    finally:
        bystander.close()


def test_every_statement_naming_a_session_names_the_incarnation(dsn: str) -> None:
    """The trigger stamps holder_server whichever statement writes holder_pid, and
    clears it when a lease is taken without a session."""
    here = sql(dsn, "select pgcoord.server_incarnation()")[0][0]
    assert here is not None
    name, part = unique("stamp"), unique("stamp-parts")
    with psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid
        conn.execute("select pgcoord.lease_acquire(%s, 'h', 60000, null)", (name,))
        assert sql(dsn, "select holder_server from pgcoord.leases where name = %s", name) == [(None,)]
        [(fence,)] = conn.execute("select fence from pgcoord.leases where name = %s", (name,)).fetchall()
        assert conn.execute("select pgcoord.lease_bind_session(%s, 'h', %s, %s)",
                            (name, fence, pid)).fetchone() == (True,)
        assert sql(dsn, "select holder_server from pgcoord.leases where name = %s", name) == [(here,)]
        sql(dsn, "insert into pgcoord.leases (name, fence) values (%s, 0)", f"{part}/0")
        conn.execute(query("partition_claim").replace("$1", "%s").replace("$2", "%s")
                     .replace("$3", "%s").replace("$4", "%s"), (part, [0], "p", 60000))
        assert sql(dsn, "select holder_pid, holder_server from pgcoord.leases where name = %s",
                   f"{part}/0") == [(pid, here)]
        conn.execute("select pg_advisory_unlock_all()")


def test_0007_goes_down_and_up_again(fresh_db: str) -> None:
    pgcoord.migrations.upgrade(fresh_db)
    name = unique("down")
    sql(fresh_db, "select pgcoord.lease_acquire(%s, 'h', 60000, null)", name)
    pgcoord.migrations.downgrade(fresh_db, "0006")
    assert sql(fresh_db, "select count(*) from information_schema.columns"
                         " where table_schema = 'pgcoord' and column_name = 'holder_server'") == [(0,)]
    holder = _doorbell_session(fresh_db, name + "2")
    try:
        holder.execute("select pgcoord.lease_acquire(%s, 'h', 60000, pg_backend_pid())", (name + "2",))
        assert sql(fresh_db, "select session_alive from pgcoord.holders where name = %s",
                   name + "2") == [(True,)]
    finally:
        holder.close()
    assert sql(fresh_db, "select fence from pgcoord.lease_acquire(%s, 'x', 60000, null)",
               name + "2") == [(2,)]
    pgcoord.migrations.upgrade(fresh_db)
    assert sql(fresh_db, "select count(*) from information_schema.columns"
                         " where table_schema = 'pgcoord' and column_name = 'holder_server'") == [(1,)]


def _reconnect(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    deadline = time.monotonic() + 30
    while True:
        try:
            return psycopg.connect(dsn, autocommit=True, connect_timeout=2)
        except psycopg.OperationalError:
            assert time.monotonic() < deadline, "the server did not come back"
            time.sleep(0.05)


def test_a_restart_waits_out_the_ttl_a_crash_restart_does_not() -> None:
    """A stopped and started server is another incarnation: a session-bound lease
    taken before waits out its ttl. A backend killed (the postmaster reinitialising
    in place) keeps the incarnation: the session is gone and the lease is free at once."""
    # synchronous_commit on: the crash must not lose the committed lease row
    with EmbeddedServer({"max_connections": "12", "synchronous_commit": "on"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        holder = _doorbell_session(server.dsn, "restarted")
        holder.execute("select pgcoord.lease_acquire('restarted', 'old', 3000, pg_backend_pid())")
        before = sql(server.dsn, "select pgcoord.server_incarnation()")[0][0]
        server.restart(immediate=False)
        holder.close()
        _reconnect(server.dsn).close()
        assert sql(server.dsn, "select pgcoord.server_incarnation()")[0][0] != before
        assert sql(server.dsn, "select * from pgcoord.lease_acquire('restarted', 'new', 3000, null)") == []
        deadline = time.monotonic() + 10
        while not sql(server.dsn, "select * from pgcoord.lease_acquire('restarted', 'new', 3000, null)"):
            assert time.monotonic() < deadline, "never free after its ttl"
            time.sleep(0.1)

        holder = _doorbell_session(server.dsn, "crashed")
        holder.execute("select pgcoord.lease_acquire('crashed', 'old', 60000, pg_backend_pid())")
        before = sql(server.dsn, "select pgcoord.server_incarnation()")[0][0]
        os.kill(holder.info.backend_pid, signal.SIGKILL)
        holder.close()
        time.sleep(0.5)  # the postmaster notices and reinitialises
        with _reconnect(server.dsn) as conn:
            assert conn.execute("select pgcoord.server_incarnation()").fetchone() == (before,)
            assert conn.execute("select fence from pgcoord.lease_acquire('crashed', 'new', 60000,"
                                " null)").fetchall() == [(2,)]


def test_a_member_of_another_incarnation_keeps_its_job_claims_until_they_expire(dsn: str) -> None:
    """After a failover the new primary cannot tell whether a member's session is gone,
    so the member's running job claims are not expired at once (a runner cut off by a
    vanished host may still run its slot): they expire on their own, as leases do."""
    job = f"incarnation-job-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = conn.execute("select coalesce(max(id), 0) + 1000 from pgcoord.member_sessions").fetchone()
        assert ids is not None
        base = int(ids[0])
        for offset, server in ((0, "another-server"), (1, None)):
            member_id = base + offset
            conn.execute(
                "insert into pgcoord.member_sessions (id, \"group\", name, pid, ttl_ms, left_at, left_reason)"
                " values (%s, 'g', %s, 1, 10000, clock_timestamp(), 'crashed')", (member_id, f"m{member_id}"))
            if server is not None:
                conn.execute("update pgcoord.member_sessions set server = %s where id = %s", (server, member_id))
            conn.execute(
                "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner, started_at, claim_expires_at)"
                " values (%s, now() - make_interval(secs => %s), 'running', 1, %s, now(), now() + interval '30 s')",
                (job, offset + 1, f"m{member_id}/{member_id}"))
        other = conn.execute("select pgcoord.job_expire_member_claims(%s)", (base,)).fetchone()
        here = conn.execute("select pgcoord.job_expire_member_claims(%s)", (base + 1,)).fetchone()
        assert (other, here) == ((0,), (1,))
        left = conn.execute("select runner from pgcoord.job_slots where job = %s"
                            " and claim_expires_at > clock_timestamp()", (job,)).fetchall()
        assert left == [(f"m{base}/{base}",)]
