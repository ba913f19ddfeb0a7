"""Multi-host DSNs, in every form a user may write them, for every feature that takes
a DSN. The first host listed refuses connections (port 1), as a dead primary does;
the failover itself is in test_ha.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgcoord
import pgcoord.migrations
from pgcoord.cli.main import main

from .conftest import sql, unique


def _port_and_db(dsn: str) -> tuple[str, str]:
    params = conninfo_to_dict(dsn)
    return str(params["port"]), str(params["dbname"])


def key_value(dsn: str) -> str:
    port, db = _port_and_db(dsn)
    return make_conninfo("", host="127.0.0.1,127.0.0.1", port=f"1,{port}", user="postgres",
                         dbname=db, target_session_attrs="read-write")


def url(dsn: str) -> str:
    port, db = _port_and_db(dsn)
    return f"postgresql://postgres@127.0.0.1:1,127.0.0.1:{port}/{db}?target_session_attrs=read-write"


@pytest.mark.parametrize("form", ["key=value", "url"])
async def test_session_features_reach_the_server_through_a_multi_host_dsn(dsn: str, form: str) -> None:
    # No driver= given: a key=value DSN goes to psycopg (asyncpg reads only URLs),
    # a URL to asyncpg when it is installed.
    multi = key_value(dsn) if form == "key=value" else url(dsn)
    name = unique("multihost")
    led = [asyncio.Event(), asyncio.Event()]

    def leader(i: int) -> Callable[[int], Awaitable[None]]:
        async def lead(fence: int) -> None:
            led[i].set()
            await asyncio.Event().wait()
        return lead

    async with pgcoord.Member(multi, group=name) as member:
        electors = [pgcoord.Elector(multi, name + ":own", ttl=5), pgcoord.Elector(member, name, ttl=5)]
        tasks = [asyncio.create_task(e.run(leader(i))) for i, e in enumerate(electors)]
        try:
            async with asyncio.timeout(10):
                await asyncio.gather(*(event.wait() for event in led))
            async with pgcoord.LockHolder(multi) as holder, holder.lock(name):
                assert sql(dsn, "select count(*) from pgcoord.holders where name = %s and granted and kind = 'advisory'",
                           name)[0][0] >= 1
        finally:
            for e in electors:
                await e.stop()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_asyncpg_refuses_a_key_value_dsn_at_once(dsn: str) -> None:
    with pytest.raises(ValueError, match="asyncpg reads only postgresql:// URLs"):
        pgcoord.LockHolder(key_value(dsn), driver="asyncpg")
    with pytest.raises(ValueError, match="asyncpg reads only"):
        pgcoord.Elector(key_value(dsn), "x", driver="asyncpg")


def test_migrate_takes_a_multi_host_url(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert pgcoord.migrations.sqlalchemy_url(
        "postgresql://u:p@a:1,b:2/db?target_session_attrs=read-write"
    ) == "postgresql+psycopg://u:p@/db?target_session_attrs=read-write&host=a:1&host=b:2"
    assert main(["migrate", "--dsn", url(fresh_db)]) == 0
    assert f"-> {pgcoord.migrations.head()}" in capsys.readouterr().out
    assert pgcoord.migrations.current(url(fresh_db)) == pgcoord.migrations.head()


def _frozen_listener() -> socket.socket:
    """A host that accepts TCP connections (the kernel completes the handshake) and
    never answers, as a frozen primary or a proxy whose backend hangs does."""
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(64)
    return frozen


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_frozen_first_host_does_not_keep_the_dsn_from_the_second(dsn: str, driver: str) -> None:
    """Each host gets its own connect timeout: an elector (ttl 2 s) whose DSN lists a
    host that never answers first leads through the second within a few seconds,
    and so does a LockHolder (keepalive 2 s)."""
    frozen = _frozen_listener()
    port, db = _port_and_db(dsn)
    multi = (f"postgresql://postgres@127.0.0.1:{frozen.getsockname()[1]},127.0.0.1:{port}/{db}"
             "?target_session_attrs=read-write")
    name = unique("frozen-first")
    led = asyncio.Event()

    async def lead(fence: int) -> None:
        led.set()
        await asyncio.Event().wait()

    elector = pgcoord.Elector(multi, name, ttl=2.0, driver=driver)
    task = asyncio.create_task(elector.run(lead))
    try:
        async with asyncio.timeout(10):
            await led.wait()
            async with pgcoord.LockHolder(multi, keepalive=2.0, driver=driver) as holder, \
                    holder.lock(name):
                assert sql(dsn, "select count(*) from pgcoord.holders where name = %s and granted and kind = 'advisory'",
                           name)[0][0] == 1
    finally:
        await elector.stop()
        await asyncio.gather(task, return_exceptions=True)
        frozen.close()


async def test_a_frozen_first_host_in_a_key_value_dsn(dsn: str) -> None:
    frozen = _frozen_listener()
    port, db = _port_and_db(dsn)
    multi = make_conninfo("", host="127.0.0.1,127.0.0.1", port=f"{frozen.getsockname()[1]},{port}",
                          user="postgres", dbname=db, target_session_attrs="read-write")
    try:
        async with asyncio.timeout(10):
            async with pgcoord.LockHolder(multi, keepalive=2.0) as holder, holder.lock(unique("kv")):
                pass
    finally:
        frozen.close()


@pytest.mark.parametrize("form", ["url", "key=value"])
def test_a_frozen_first_host_does_not_stall_the_operator_commands(dsn: str, form: str) -> None:
    """status, jobs and doctor give each host its own connect timeout too: a first host
    that never answers costs them its timeout, not the whole command."""
    import subprocess
    import sys
    import time

    frozen = _frozen_listener()
    port, db = _port_and_db(dsn)
    frozen_port = frozen.getsockname()[1]
    if form == "url":
        multi = (f"postgresql://postgres@127.0.0.1:{frozen_port},127.0.0.1:{port}/{db}"
                 "?target_session_attrs=read-write&connect_timeout=2")
    else:
        multi = make_conninfo("", host="127.0.0.1,127.0.0.1", port=f"{frozen_port},{port}",
                              user="postgres", dbname=db, target_session_attrs="read-write",
                              connect_timeout="2")
    try:
        for command in (["status"], ["jobs"], ["doctor"]):
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pgcoord.cli", *command, "--dsn", multi],
                                  capture_output=True, text=True, timeout=60)
            took = time.monotonic() - started
            # doctor exits 1 when a check fails (this throwaway server is not tuned): not
            # a connection failure, which would be exit 2 with "could not connect".
            assert "could not connect" not in done.stderr, (command, done.stderr)
            assert done.returncode in (0, 1), (command, done.returncode, done.stderr)
            assert took < 20, (command, took)
    finally:
        frozen.close()


def test_a_frozen_first_host_does_not_stall_the_sync_twins(dsn: str) -> None:
    import pgcoord.sync

    frozen = _frozen_listener()
    port, db = _port_and_db(dsn)
    multi = (f"postgresql://postgres@127.0.0.1:{frozen.getsockname()[1]},127.0.0.1:{port}/{db}"
             "?target_session_attrs=read-write")
    name = unique("frozen-sync")
    try:
        with pgcoord.sync.LockHolder(multi, keepalive=2.0) as holder, holder.lock(name):
            assert sql(dsn, "select count(*) from pgcoord.holders where key = pgcoord.lock_key(%s)"
                            " and granted", name)[0][0] == 1
    finally:
        frozen.close()
