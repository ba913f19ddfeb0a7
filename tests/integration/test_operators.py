"""What operators and newcomers meet: pgcoord status, the demo, metrics, least-privilege roles."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import asyncpg
import psycopg
import pytest

import pgcoord
from pgcoord._core.resources import read_sql

from .conftest import Server


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgcoord.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"})


async def test_status_fits_80_columns_names_locks_and_shows_leases_and_waiters(dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=3,
                                     server_settings={"application_name": "billing-worker"})
    lease = pgcoord.Lease(pool, "status:invoice-run", ttl=30, holder="billing-7")
    try:
        await lease.acquire()
        async with pgcoord.exclusive(pool, "status:a-rather-long-lock-name-for-the-table"):
            waiter = asyncio.create_task(_wait_for(pool, "status:a-rather-long-lock-name-for-the-table"))
            await asyncio.sleep(0.3)
            result = await asyncio.to_thread(cli, "status", "--dsn", dsn)
            as_json = await asyncio.to_thread(cli, "status", "--dsn", dsn, "--json")
        await waiter
    finally:
        await lease.release()
        await pool.close()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    text = result.stdout
    assert "status:a-rather-long" in text and "#" not in text  # names, never bare keys
    assert "billing-wo" in text and "waiting" in text and "waits for pid" in text
    assert "status:invoice-run" in text and "billing-7" in text
    rows = json.loads(as_json.stdout)
    kinds = {(r["kind"], r["name"], r["granted"]) for r in rows}
    assert ("lease", "status:invoice-run", True) in kinds
    assert ("advisory", "status:a-rather-long-lock-name-for-the-table", False) in kinds
    lease_row = next(r for r in rows if r["kind"] == "lease" and r["name"] == "status:invoice-run")
    assert lease_row["fence"] >= 1 and lease_row["holder"] == "billing-7"


async def _wait_for(pool: asyncpg.Pool, name: str) -> None:
    async with pgcoord.exclusive(pool, name):
        pass


def test_status_without_the_schema_says_how_to_install_it(fresh_db: str) -> None:
    result = cli("status", "--dsn", fresh_db)
    assert result.returncode == 4  # schema missing; the exit codes are in `pgcoord --help`
    assert "pgcoord migrate" in result.stderr and "Traceback" not in result.stderr


def test_the_demo_shows_every_step(dsn: str) -> None:
    result = cli("demo", "--dsn", dsn, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for step in range(1, 7):
        assert f"[{step}/6]" in out, out
    assert "took over with fence" in out and "rejected: pgcoord: stale fence" in out
    assert "(each slot once)" in out
    assert "after the new leader's first write: 0" in out


async def test_prometheus_metrics_after_a_failover(dsn: str, room_for_lock_labels: None) -> None:
    from prometheus_client import REGISTRY, generate_latest

    name = f"metrics:{uuid.uuid4().hex[:6]}"
    ours = pgcoord.Elector(dsn, name, ttl=2.0, holder="here")
    other = pgcoord.Elector(dsn, name, ttl=2.0, holder="there")

    async def lead(fence: int) -> None:
        await asyncio.sleep(3600)

    t1 = asyncio.create_task(ours.run(lead))
    for _ in range(500):
        if ours.is_leader:
            break
        await asyncio.sleep(0.01)
    assert REGISTRY.get_sample_value("pgcoord_is_leader", {"name": name}) == 1
    assert REGISTRY.get_sample_value("pgcoord_fence", {"name": name}) == ours.fence
    t2 = asyncio.create_task(other.run(lead))
    await asyncio.sleep(1.0)  # a renewal or two
    with psycopg.connect(dsn, autocommit=True) as admin:  # fail over: kill our session
        admin.execute("select pg_terminate_backend(%s)", (ours._conn.backend_pid,))  # type: ignore[union-attr]
    for _ in range(500):
        if other.is_leader:
            break
        await asyncio.sleep(0.01)
    await ours.stop()
    scraped = generate_latest().decode()
    await other.stop()
    await asyncio.gather(t1, t2)
    assert f'pgcoord_leadership_changes_total{{name="{name}"}}' in scraped
    assert REGISTRY.get_sample_value("pgcoord_leadership_changes_total", {"name": name}) >= 3
    assert REGISTRY.get_sample_value("pgcoord_lease_renewal_seconds_count", {"name": name}) >= 1
    assert REGISTRY.get_sample_value("pgcoord_locks_lost_total", {"name": name}) >= 1
    # labels by name only: no holder, key or pid label anywhere (a schedule's handler
    # is a function's name in code, so pgcoord_jobs_failing counts by it)
    for line in scraped.splitlines():
        if line.startswith("pgcoord_") and "{" in line:
            labels = line[line.index("{") + 1:line.index("}")]
            assert {part.split("=")[0] for part in labels.split(",")} <= {"name", "le", "handler"}, line


def test_least_privilege_roles(pg_server: Server, fresh_db: str) -> None:
    """A service role can use every feature; an operator role can only read the view."""
    import pgcoord.migrations

    pgcoord.migrations.upgrade(fresh_db)
    suffix = uuid.uuid4().hex[:6]
    service, operator = f"svc_{suffix}", f"ops_{suffix}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {service} login; create role {operator} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", service)
                      .replace("pgcoord_operator", operator))
    base = fresh_db.replace("postgres@", "{}@")
    try:
        asyncio.run(_as_service(base.format(service), fresh_db))
        with psycopg.connect(base.format(operator)) as ops:
            ops.execute("select * from pgcoord.holders").fetchall()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                ops.execute("update pgcoord.leases set fence = 0")
            ops.rollback()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                ops.execute("select pgcoord.lease_acquire('x', 'ops', 1000, null)")
            ops.rollback()
            ops.execute("select * from pgcoord.schedules, pgcoord.job_slots").fetchall()  # pgcoord jobs
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                ops.execute("select pgcoord.schedule_trigger('roles:job')")
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename in ('{service}', '{operator}')")
            admin.execute(f"drop owned by {service}; drop owned by {operator};"
                          f" drop role {service}; drop role {operator}")


async def _as_service(dsn: str, admin_dsn: str) -> None:
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    try:
        async with pgcoord.exclusive(pool, "roles:lock") as conn:
            await conn.execute("select 1")
        async with pgcoord.Lease(pool, "roles:lease", ttl=5) as fence:
            async with pool.acquire() as conn, conn.transaction():
                await pgcoord.check_fence(conn, "roles:lease", fence)
        sched = pgcoord.Scheduler(pool)
        ran = []

        @sched.cron("roles:job", "0 0 1 1 *")
        async def job(slot: pgcoord.Slot) -> None:
            ran.append(slot)

        await sched.trigger("roles:job")
        await sched.prune("roles:job")
        assert ran
        await _schedules_as_service(pool, admin_dsn)
        async with pgcoord.LockHolder(dsn) as holder, holder.lock("roles:session"):
            pass
        # Semaphores in both scopes, named in the registry (which needs the grant).
        async with pgcoord.semaphore(pool, "roles:semaphore", limit=2), \
                pgcoord.LockHolder(dsn) as holder, holder.semaphore("roles:semaphore", limit=2):
            async with pool.acquire() as conn:
                assert await conn.fetchval(
                    "select count(*) from pgcoord.holders where kind = 'semaphore'"
                    " and name = 'roles:semaphore'") == 2
        # A member, and every feature on it.
        async with pgcoord.Member(dsn, group="roles") as member, pgcoord.LockHolder(member) as held:
            async with held.lock("roles:member-lock"):
                pass
            led = asyncio.Event()

            async def lead(fence: int) -> None:
                led.set()
                await asyncio.sleep(3600)

            elector = pgcoord.Elector(member, "roles:elector", ttl=5)
            running = asyncio.create_task(elector.run(lead))
            await asyncio.wait_for(led.wait(), 10)
            assert await pgcoord.request_resign(member, "roles:elector")
            await elector.stop()
            await running
            async with pgcoord.Lease(pool, "roles:member-lease", ttl=5, member=member):
                pass
            assert [p.name for p in await member.peers()] == [member.name]
    finally:
        await pool.close()


async def _schedules_as_service(pool: asyncpg.Pool, admin_dsn: str) -> None:
    """Schedules at runtime (0006): add, change, run a tick, pause, resume, remove."""
    sched = pgcoord.Scheduler(pool)
    ran = []

    @sched.job("roles:handler")
    async def handler(slot: pgcoord.Slot) -> None:
        ran.append(slot)

    await sched.add("roles:schedule", "0 0 1 1 *", handler="roles:handler")
    await sched.update("roles:schedule", expr="0 0 2 1 *", args={"x": 1})
    await sched.pause("roles:schedule")
    await sched.resume("roles:schedule", catch_up="latest")
    await sched.trigger("roles:schedule")
    assert ran and ran[0].args == {"x": 1}
    await sched.tick()
    # A run owed from SQL (pgcoord jobs trigger) is taken by the next tick: deleting
    # the owed row FOR UPDATE SKIP LOCKED needs UPDATE on schedule_owed.
    async with pool.acquire() as conn:
        owed_at = await conn.fetchval("select pgcoord.schedule_trigger('roles:schedule')")
    await sched.tick()
    for _ in range(200):
        if any(s.manual and s.at == owed_at for s in ran):
            break
        await asyncio.sleep(0.05)
    assert any(s.manual and s.at == owed_at for s in ran), "the owed run did not start"
    async with pool.acquire() as conn:
        assert not await conn.fetchval("select count(*) from pgcoord.schedule_owed")
    # Without that grant, taking an owed run fails, but the tick's housekeeping
    # still runs: a lost claim (expired) is recorded abandoned, and tick() returns.
    user = await pool.fetchval("select current_user")
    async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as admin:
        await admin.execute(f"revoke update on pgcoord.schedule_owed from {user}")
        try:
            async with pool.acquire() as conn:
                await conn.execute(
                    "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner,"
                    " started_at, claim_expires_at) values ('roles:schedule',"
                    " '2001-01-01', 'running', 1, 'gone', now(), now() - interval '1 s')")
                await conn.fetchval("select pgcoord.schedule_trigger('roles:schedule')")
            sched._last_recover = 0.0
            await sched.tick()
            async with pool.acquire() as conn:
                assert await conn.fetchval(
                    "select state from pgcoord.job_slots where job = 'roles:schedule'"
                    " and slot_at = '2001-01-01'") == "abandoned"
                await conn.execute("delete from pgcoord.schedule_owed")
        finally:
            await admin.execute(f"grant update on pgcoord.schedule_owed to {user}")
    assert [i.name for i in await sched.schedules()] == ["roles:schedule"]
    await sched.remove("roles:schedule")


async def test_lock_metrics_count_waits_busy_results_and_losses(
    dsn: str, room_for_lock_labels: None,
) -> None:
    from prometheus_client import REGISTRY

    name = f"metrics-lock:{uuid.uuid4().hex[:6]}"
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=3)
    try:
        async with pgcoord.exclusive(pool, name):
            with pytest.raises(pgcoord.LockBusy):
                async with pgcoord.exclusive(pool, name, wait=False):
                    pass
        async with pgcoord.LockHolder(dsn, keepalive=1.0) as holder:
            with pytest.raises(pgcoord.LockLost):
                async with holder.lock(name):
                    with psycopg.connect(dsn, autocommit=True) as admin:
                        admin.execute("select pg_terminate_backend(%s)", (holder.backend_pid,))
                    await asyncio.sleep(5)
    finally:
        await pool.close()
    assert REGISTRY.get_sample_value("pgcoord_lock_wait_seconds_count", {"name": name}) == 2
    assert REGISTRY.get_sample_value("pgcoord_lock_busy_total", {"name": name}) == 1
    assert REGISTRY.get_sample_value("pgcoord_locks_lost_total", {"name": name}) == 1


async def test_lock_metrics_label_a_bounded_number_of_names(
    dsn: str, room_for_lock_labels: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Locks taken per entity (a name per order) must not make a series per entity:
    past the first names a process uses, the rest share one label."""
    from prometheus_client import REGISTRY

    from pgcoord.observability import metrics

    monkeypatch.setattr(metrics, "LOCK_NAMES_LABELLED", 3)
    other = {"name": metrics.OTHER_NAMES}
    before = REGISTRY.get_sample_value("pgcoord_lock_wait_seconds_count", other) or 0
    names = [f"order:{uuid.uuid4().hex[:8]}" for _ in range(6)]
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        for name in [*names, names[0]]:
            async with pgcoord.exclusive(pool, name):
                pass
    finally:
        await pool.close()
    counts = [REGISTRY.get_sample_value("pgcoord_lock_wait_seconds_count", {"name": n})
              for n in names]
    assert counts == [2, 1, 1, None, None, None]
    assert REGISTRY.get_sample_value("pgcoord_lock_wait_seconds_count", other) == before + 3
