"""Leases, fences and check_fence (docs/leases.md) on a real server."""

from __future__ import annotations

import asyncio
import threading
import time

import asyncpg
import psycopg
import psycopg_pool
import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine

import pgcoord

from .conftest import sql, unique
from .converted_cancel import cancelling_after_loss
from .sources import open_async


@pytest.mark.parametrize("kind", ["asyncpg-pool", "psycopg-pool", "sa-async-asyncpg"])
async def test_fences_increase_by_one_on_every_change_of_holder(kind: str, dsn: str) -> None:
    name = unique("lease:fence")
    async with open_async(kind, dsn) as source:
        fences = []
        for _ in range(3):
            async with pgcoord.Lease(source, name, ttl=5) as fence:
                fences.append(fence)
                assert sql(dsn, "select holder is not null, fence from pgcoord.leases where name = %s",
                           name) == [(True, fence)]
        assert fences == [1, 2, 3]
        # Released, the row stays, with its fence, so fences never go backwards.
        assert sql(dsn, "select holder, fence from pgcoord.leases where name = %s", name) == [(None, 3)]


async def test_a_held_lease_is_busy_for_others_and_times_out(dsn: str) -> None:
    name = unique("lease:busy")
    async with open_async("asyncpg-pool", dsn) as source:
        async with pgcoord.Lease(source, name, ttl=5):
            other = pgcoord.Lease(source, name, ttl=5)
            with pytest.raises(pgcoord.LockBusy):
                await other.acquire(wait=False)
            started = time.monotonic()
            with pytest.raises(pgcoord.LockTimeout):
                await other.acquire(timeout=0.4)
            assert 0.35 <= time.monotonic() - started < 5
            assert other.fence is None and not other.valid


async def test_renewal_keeps_the_lease_past_its_ttl(dsn: str) -> None:
    name = unique("lease:renew")
    async with open_async("psycopg-pool", dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=0.6)
        async with lease:
            await asyncio.sleep(2.0)
            assert lease.valid
            lease.ensure()
            (still,) = sql(dsn, "select expires_at > clock_timestamp() from pgcoord.leases"
                                " where name = %s", name)
            assert still == (True,)
        assert not lease.valid
        with pytest.raises(pgcoord.LeaseLost):
            lease.ensure()


def test_renew_and_release_are_scoped_to_the_exact_holder_and_fence(dsn: str) -> None:
    name = unique("lease:scoped")
    [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'alice', 5000, null)", name)
    for holder, f in (("mallory", fence), ("alice", fence + 1), ("alice", fence - 1)):
        assert sql(dsn, "select * from pgcoord.lease_renew(%s, %s, %s, 60000)", name, holder, f) == []
        assert sql(dsn, "select * from pgcoord.lease_release(%s, %s, %s)", name, holder, f) == []
    assert sql(dsn, "select holder, fence from pgcoord.leases where name = %s", name) == [
        ("alice", fence)]
    # A second would-be leader cannot take a live lease.
    assert sql(dsn, "select * from pgcoord.lease_acquire(%s, 'bob', 5000, null)", name) == []


def test_an_expired_lease_is_never_renewed_not_even_by_its_last_holder(dsn: str) -> None:
    name = unique("lease:expired")
    [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'alice', 200, null)", name)
    time.sleep(0.35)
    assert sql(dsn, "select * from pgcoord.lease_renew(%s, 'alice', %s, 5000)", name, fence) == []
    [(again, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'alice', 5000, null)", name)
    assert again == fence + 1


async def test_a_takeover_cancels_the_body_with_lease_lost(dsn: str) -> None:
    """A real loss (renewal finds the lease gone) is never mistaken for a transient error."""
    name = unique("lease:taken")
    async with open_async("asyncpg-pool", dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=3.0)
        holding = asyncio.Event()
        cancelled_at = 0.0

        async def body() -> None:
            nonlocal cancelled_at
            async with lease:
                holding.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    cancelled_at = time.monotonic()
                    raise

        task = asyncio.create_task(body())
        await holding.wait()
        # Someone with database access ends the lease and takes it over.
        sql(dsn, "update pgcoord.leases set expires_at = clock_timestamp() where name = %s", name)
        sql(dsn, "select * from pgcoord.lease_acquire(%s, 'usurper', 60000, null)", name)
        taken_at = time.monotonic()
        with pytest.raises(pgcoord.LeaseLost, match="expired or was taken over"):
            await task
        # Found at the next renewal (every ttl/3), well before the trust window closes.
        assert cancelled_at - taken_at <= 3.0 / 3 + 0.5
        assert not lease.valid


async def test_a_loss_taken_for_an_error_leaves_the_task_not_cancelling(dsn: str) -> None:
    """A driver may turn the body's cancellation into an error (psycopg before 3.3, as a
    connection breaks). LeaseLost still comes, and the cancellation pgcoord sent is
    withdrawn: the task's cancelling() count is back to 0, so an enclosing TaskGroup or
    timeout, or a later retry loop that checks it, is not misled."""
    name = unique("lease:converted")
    async with open_async("asyncpg-pool", dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=3.0)
        holding = asyncio.Event()
        task = asyncio.create_task(cancelling_after_loss(lease, holding, pgcoord.LeaseLost))
        await holding.wait()
        sql(dsn, "update pgcoord.leases set expires_at = clock_timestamp() where name = %s", name)
        sql(dsn, "select * from pgcoord.lease_acquire(%s, 'usurper', 60000, null)", name)
        assert await asyncio.wait_for(task, 10) == 0


async def test_a_transient_renewal_error_is_not_a_loss(
    dsn: str, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="pgcoord.leases")
    name = unique("lease:transient")
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False,
                                                check=None) as pool:
        await pool.wait()
        lease = pgcoord.Lease(pool, name, ttl=1.5)
        async with lease as fence:
            # Every connection of the pool dies; the next renewal fails on one, and
            # is made on a replacement.
            sql(dsn, "select pg_terminate_backend(pid) from pg_stat_activity"
                     " where datname = current_database() and state = 'idle'"
                     " and pid <> pg_backend_pid()")
            await asyncio.sleep(2.5)
            assert lease.valid and lease.fence == fence
            assert "dead connection" in caplog.text  # the error really happened
        assert sql(dsn, "select holder, fence from pgcoord.leases where name = %s", name) == [
            (None, fence)]


async def test_the_trust_window_closes_across_a_pause(dsn: str) -> None:
    name = unique("lease:pause")
    async with open_async("asyncpg-pool", dsn) as source:
        lease = pgcoord.Lease(source, name, ttl=1.0)
        with pytest.raises(pgcoord.LeaseLost):
            async with lease:
                time.sleep(1.2)  # the whole event loop stops, as in a GC pause or SIGSTOP
                assert not lease.valid  # believed nothing the moment it resumed
                with pytest.raises(pgcoord.LeaseLost):
                    lease.ensure()
                await asyncio.sleep(5)  # cancelled here by the renewer


# -- check_fence ---------------------------------------------------------------------------

@pytest.fixture
def fenced(dsn: str) -> tuple[str, int]:
    name = unique("lease:check")
    sql(dsn, "create table if not exists lease_fenced_writes (id serial, name text, fence bigint)")
    [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'writer', 60000, null)", name)
    return name, fence


async def test_check_fence_on_every_async_connection(dsn: str, fenced: tuple[str, int]) -> None:
    name, fence = fenced
    conn = await asyncpg.connect(dsn)
    async with conn.transaction():
        await pgcoord.check_fence(conn, name, fence)
        with pytest.raises(pgcoord.StaleFence, match="stale fence"):
            async with conn.transaction():
                await pgcoord.check_fence(conn, name, fence - 1)
    await conn.close()
    async with await psycopg.AsyncConnection.connect(dsn) as pconn:
        await pgcoord.check_fence(pconn, name, fence)
        await pconn.rollback()
        with pytest.raises(pgcoord.StaleFence):
            await pgcoord.check_fence(pconn, name, fence + 1)
    engine = create_async_engine(dsn.replace("postgresql://", "postgresql+asyncpg://"))
    async with engine.connect() as saconn:
        await pgcoord.check_fence(saconn, name, fence)
        await saconn.rollback()
        with pytest.raises(pgcoord.StaleFence):
            await pgcoord.check_fence(saconn, name, 0)
    await engine.dispose()


def test_check_fence_on_sync_connections(dsn: str, fenced: tuple[str, int]) -> None:
    name, fence = fenced
    with psycopg.connect(dsn) as conn:
        assert pgcoord.check_fence(conn, name, fence) is None
        conn.rollback()
        with pytest.raises(pgcoord.StaleFence):
            pgcoord.check_fence(conn, name, fence + 5)
    engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as saconn:
        pgcoord.check_fence(saconn, name, fence)
        saconn.rollback()
        with pytest.raises(pgcoord.StaleFence):
            pgcoord.check_fence(saconn, "no-such-lease", 1)
    engine.dispose()


def test_the_sql_function_raises_its_own_sqlstate(dsn: str, fenced: tuple[str, int]) -> None:
    name, fence = fenced
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("select pgcoord.check_fence(%s, %s)", (name, fence))
        for stale in (fence - 1, fence + 1):
            with pytest.raises(psycopg.Error) as info:
                conn.execute("select pgcoord.check_fence(%s, %s)", (name, stale))
            assert info.value.sqlstate == "PC002"
        conn.execute("select * from pgcoord.lease_release(%s, 'writer', %s)", (name, fence))
        with pytest.raises(psycopg.Error, match="released") as info:
            conn.execute("select pgcoord.check_fence(%s, %s)", (name, fence))
        assert info.value.sqlstate == "PC002"


def test_a_takeover_waits_for_a_fenced_transaction_to_finish(dsn: str) -> None:
    name = unique("lease:share")
    sql(dsn, "create table if not exists lease_fenced_writes (id serial, name text, fence bigint)")
    [(fence, _)] = sql(dsn, "select * from pgcoord.lease_acquire(%s, 'old', 300, null)", name)
    taken: list[float] = []
    with psycopg.connect(dsn) as writer:
        pgcoord.check_fence(writer, name, fence)  # row now FOR SHARE in writer's transaction
        time.sleep(0.4)  # the lease expires meanwhile; a takeover is allowed but must wait

        def take_over() -> None:
            sql(dsn, "select * from pgcoord.lease_acquire(%s, 'new', 60000, null)", name)
            taken.append(time.monotonic())

        thread = threading.Thread(target=take_over)
        thread.start()
        time.sleep(0.5)
        assert taken == []  # blocked behind the fenced transaction
        writer.execute("insert into lease_fenced_writes (name, fence) values (%s, %s)", (name, fence))
        committed = time.monotonic()
        writer.commit()
        thread.join(10)
    assert taken and taken[0] >= committed
    assert sql(dsn, "select fence from pgcoord.leases where name = %s", name) == [(fence + 1,)]


async def test_holders_view_shows_a_lease_with_fence_and_expiry(dsn: str) -> None:
    name = unique("lease:view")
    async with open_async("asyncpg-pool", dsn) as source, \
            pgcoord.Lease(source, name, ttl=5, holder="replica-a") as fence:
        rows = sql(dsn, "select kind, holder, fence, expires_at > now(), session_alive"
                        " from pgcoord.holders where name = %s", name)
        assert rows == [("lease", "replica-a", fence, True, None)]
    assert sql(dsn, "select count(*) from pgcoord.holders where name = %s", name) == [(0,)]


async def test_bad_lease_arguments_raise_at_construction(dsn: str) -> None:
    with psycopg.connect(dsn) as sync_conn, pytest.raises(TypeError, match="async"):
        pgcoord.Lease(sync_conn, "x", ttl=1)
    async with psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        with pytest.raises(ValueError):
            pgcoord.Lease(pool, "x", ttl=-1)
        with pytest.raises(TypeError):
            pgcoord.Lease(pool, 5, ttl=1)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            pgcoord.Lease(pool, "", ttl=1)
    with pytest.raises(pgcoord.UnsupportedConnection):
        pgcoord.Lease(object(), "x", ttl=1)


async def test_without_the_schema_leases_and_the_elector_raise_schema_missing(fresh_db: str) -> None:
    """The error says what to run, instead of a driver's 'relation does not exist'."""
    pool = await asyncpg.create_pool(fresh_db, min_size=1, max_size=2)
    try:
        with pytest.raises(pgcoord.SchemaMissing):
            await pgcoord.Lease(pool, "no-schema", ttl=5).acquire(wait=False)
        async with pool.acquire() as conn, conn.transaction():
            with pytest.raises(pgcoord.SchemaMissing):
                await pgcoord.check_fence(conn, "no-schema", 1)
    finally:
        await pool.close()
    with pytest.raises(pgcoord.SchemaMissing):
        await pgcoord.Elector(fresh_db, "no-schema", ttl=5).leader()
