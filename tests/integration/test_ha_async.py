"""What an asynchronous standby loses on failover, and that doctor says so.

The primary does not wait for its standby, so a lease takeover acknowledged to
its new holder (with its fence) can be missing from the standby when the primary
dies. After the promotion the fence has gone back by the lag: the new holder's
fence is stale on the new primary, and the holder it replaced is current again.
This is why docs/operations.md asks for a synchronous standby and why
``pgcoord doctor`` warns about asynchronous ones.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterator

import psycopg
import psycopg_pool
import pytest

import pgcoord
import pgcoord.migrations
from pgcoord.cli.doctor import run_checks

from .ha import StandbyPair


@pytest.fixture(scope="module")
def pair() -> Iterator[StandbyPair]:
    with StandbyPair(synchronous=False, through_proxy=True) as pair:
        pgcoord.migrations.upgrade(pair.url())
        pair.wait_replayed()
        yield pair


def test_doctor_warns_about_an_asynchronous_standby_and_fails_on_a_standby(pair: StandbyPair) -> None:
    checks = {c.name: c for c in run_checks(pair.libpq_dsn())}
    assert checks["replication"].status == "warn"
    assert "fence can go back" in checks["replication"].detail
    assert "synchronous_standby_names" in checks["replication"].fix
    on_standby = {c.name: c for c in run_checks(pair.standby.dsn)}
    assert on_standby["replication"].status == "fail"
    assert "target_session_attrs=read-write" in on_standby["replication"].fix


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_live_standby_listed_first_is_passed_over(pair: StandbyPair, driver: str) -> None:
    """target_session_attrs=read-write with the standby, up and answering, listed first:
    an elector leads and a LockHolder locks on the primary (asyncpg is given one host
    at a time by pgcoord, so the attribute check must still move it on)."""
    standby_first = (f"postgresql://postgres@127.0.0.1:{pair.standby.port},"
                     f"127.0.0.1:{pair.primary.port}/postgres?target_session_attrs=read-write")
    name = f"standby-first:{driver}"
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.Event().wait()

    elector = pgcoord.Elector(standby_first, name, ttl=2.0, driver=driver)
    task = asyncio.create_task(elector.run(lead))
    try:
        async with asyncio.timeout(10):
            await led.wait()
            async with pgcoord.LockHolder(standby_first, keepalive=2.0, driver=driver) as holder, \
                    holder.lock(name):
                with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
                    [(lease, lock)] = conn.execute(
                        "select exists (select from pgcoord.leases where name = %s"
                        "               and expires_at > clock_timestamp()),"
                        " exists (select from pg_locks where locktype = 'advisory' and granted"
                        "         and ((classid::bigint << 32) | objid::bigint) = pgcoord.lock_key(%s))",
                        (name, name)).fetchall()
        assert (lease, lock) == (True, True)  # the elector's lease and the lock, on the primary
    finally:
        await elector.stop()
        await asyncio.gather(task, return_exceptions=True)


def test_doctor_names_standbys_whose_promotion_loses_commits(pair: StandbyPair) -> None:
    """One synchronous standby and another, asynchronous, walsender (a WAL archiver
    here): promoting the other takes fences back, so doctor warns and names it. With
    quorum commit (ANY n) a commit waits for only some of the standbys: a warning too."""
    def configure(names: str) -> None:
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            conn.execute(f"alter system set synchronous_standby_names = '{names}'")
            conn.execute("alter system set wal_sender_timeout = '60s'")  # the archiver never replies
            conn.execute("select pg_reload_conf()")

    def states(want: dict[str, str]) -> None:
        deadline = time.monotonic() + 10
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            while dict(conn.execute("select application_name, sync_state from pg_stat_replication")
                       .fetchall()) != want:
                assert time.monotonic() < deadline, "the standbys' states did not change"
                time.sleep(0.05)

    configure("standby1")
    with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
        lsn = str(conn.execute("select pg_current_wal_lsn()").fetchone()[0])  # type: ignore[index]
    archiver = psycopg.connect(f"{pair.primary.dsn}?replication=true&application_name=archiver",
                               autocommit=True)
    try:
        archiver.pgconn.send_query(f"START_REPLICATION PHYSICAL {lsn}".encode())
        states({"standby1": "sync", "archiver": "async"})
        checks = {c.name: c for c in run_checks(pair.libpq_dsn())}
        assert checks["replication"].status == "warn", checks["replication"]
        assert "archiver" in checks["replication"].detail and "standby1" not in checks["replication"].detail
        archiver.close()
        configure("ANY 1 (standby1)")
        states({"standby1": "quorum"})
        checks = {c.name: c for c in run_checks(pair.libpq_dsn())}
        assert checks["replication"].status == "warn", checks["replication"]
        assert "quorum" in checks["replication"].detail
    finally:
        archiver.close()
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            conn.execute("alter system reset synchronous_standby_names")
            conn.execute("alter system reset wal_sender_timeout")
            conn.execute("select pg_reload_conf()")
        states({"standby1": "async"})


def test_doctor_fails_a_standby_whose_clock_is_ahead(pair: StandbyPair) -> None:
    """A lease's expiry is stamped by the primary's clock and, after a failover, read
    by the standby's: a standby clock ahead expires leases early there, while their
    old holders still believe. doctor reads each standby's clock from its replies
    (pg_stat_replication.reply_time). Here a replication client whose replies are
    stamped 3 s ahead stands for such a standby."""
    checks = {c.name: c for c in run_checks(pair.libpq_dsn())}
    assert checks["standby_clock"].status == "pass", checks["standby_clock"]
    with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
        lsn = str(conn.execute("select pg_current_wal_lsn()").fetchone()[0])  # type: ignore[index]
        conn.execute("alter system set wal_sender_timeout = '60s'")
        conn.execute("select pg_reload_conf()")
    ahead = psycopg.connect(f"{pair.primary.dsn}?replication=true&application_name=fast_clock",
                            autocommit=True)
    try:
        ahead.pgconn.send_query(f"START_REPLICATION PHYSICAL {lsn}".encode())
        assert ahead.pgconn.get_result().status == psycopg.pq.ExecStatus.COPY_BOTH  # type: ignore[union-attr]
        hi, lo = (int(part, 16) for part in lsn.split("/"))
        position = (hi << 32) | lo
        micros = int((time.time() + 3.0 - 946684800) * 1_000_000)  # since 2000-01-01, 3 s ahead
        status = b"r" + struct.pack("!QQQqB", position, position, position, micros, 0)
        ahead.pgconn.put_copy_data(status)
        ahead.pgconn.flush()
        deadline = time.monotonic() + 10
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            while conn.execute("select reply_time is not null from pg_stat_replication"
                               " where application_name = 'fast_clock'").fetchone() != (True,):
                assert time.monotonic() < deadline, "no reply seen"
                time.sleep(0.05)
        checks = {c.name: c for c in run_checks(pair.libpq_dsn())}
    finally:
        ahead.close()
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            conn.execute("alter system reset wal_sender_timeout")
            conn.execute("select pg_reload_conf()")
    assert checks["standby_clock"].status == "fail", checks["standby_clock"]
    assert "fast_clock" in checks["standby_clock"].detail and "NTP" in checks["standby_clock"].fix


async def _fenced_write(pool: psycopg_pool.AsyncConnectionPool, name: str, fence: int) -> None:
    async with pool.connection() as conn, conn.transaction():
        await pgcoord.check_fence(conn, name, fence)
        await conn.execute("insert into async_writes (fence) values (%s)", (fence,))


async def test_a_fence_goes_back_by_the_lag(pair: StandbyPair) -> None:
    name = "async:lease"
    with psycopg.connect(pair.libpq_dsn(), autocommit=True) as conn:
        conn.execute("create table async_writes (id serial primary key, fence bigint)")
    # check: a connection to the old primary is replaced when next lent, not lent broken.
    pool = psycopg_pool.AsyncConnectionPool(
        pair.libpq_dsn(), min_size=1, max_size=3, open=False, kwargs={"autocommit": True},
        timeout=10, check=psycopg_pool.AsyncConnectionPool.check_connection)
    await pool.open()
    try:
        first = pgcoord.Lease(pool, name, ttl=60.0, holder="first")
        old_fence = await first.acquire()
        await _fenced_write(pool, name, old_fence)
        await asyncio.to_thread(pair.wait_replayed)

        # From here the standby hears nothing; the primary commits on regardless.
        pair.cut_replication()
        await first.release()
        second = pgcoord.Lease(pool, name, ttl=60.0, holder="second")
        new_fence = await second.acquire()
        await _fenced_write(pool, name, new_fence)  # acknowledged: committed on the primary
        assert new_fence > old_fence
        await asyncio.to_thread(pair.fail_over)

        with psycopg.connect(pair.libpq_dsn(), autocommit=True) as conn:
            assert conn.info.port == pair.standby.port
            [(holder, fence)] = conn.execute("select holder, fence from pgcoord.leases"
                                             " where name = %s", (name,)).fetchall()
            written = [f for (f,) in conn.execute("select fence from async_writes order by id")]
        # The fence went back by the lag: the release, the takeover and its write are
        # gone, and the holder it replaced holds the lease again on the new primary.
        assert (holder, fence) == ("first", old_fence)
        assert written == [old_fence]
        await _fenced_write(pool, name, old_fence)  # the replaced holder's write is accepted
        with pytest.raises(pgcoord.StaleFence):
            await _fenced_write(pool, name, new_fence)  # the acknowledged one's is not
        await second.release()
    finally:
        await pool.close()
