"""A crash is told as a crash to every watcher, whichever of them marked it.

Two members of one process die together; two live members of another process watch
them (the ring interleaves the two processes). Both watchers are granted at once, one
of them marks both deaths, and the other finds its target marked already: it must
not tell its own member that the target *left* (a goodbye) when it crashed. The
NOTIFY that the marking sends would usually win that race and hide it; with the
listeners' register held, nobody listens, and what each watcher tells its own member
is all there is."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pgcoord

from .conftest import migrated_database

DOOMED = """
import asyncio, sys
import pgcoord

async def main(dsn, group):
    members = []
    loop = asyncio.get_running_loop()
    for line in iter(sys.stdin.readline, ""):
        member = pgcoord.Member(dsn, group=group, ttl=30.0)
        await member.open()
        members.append(member)
        print(f"JOINED {member.id}", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:3]))
"""


@pytest.fixture
def own_dsn(pg_server: Any) -> Iterator[str]:
    """A database of its own: its ring holds this test's members only."""
    yield from migrated_database(pg_server, "pgcoord_reason")


@pytest.mark.parametrize("listening", [True, False])
async def test_members_dying_together_are_told_crashed_by_every_watcher(own_dsn: str, listening: bool) -> None:
    dsn = own_dsn
    group = f"reason-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", DOOMED, dsn, group], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    live: list[pgcoord.Member] = []
    doomed: list[int] = []
    try:
        for _ in range(2):  # doomed, live, doomed, live: each live member watches a doomed one
            proc.stdin.write("join\n")
            proc.stdin.flush()
            line = (await asyncio.to_thread(proc.stdout.readline)).split()
            assert line[0] == "JOINED"
            doomed.append(int(line[1]))
            member = pgcoord.Member(dsn, group=group, ttl=30.0)
            await member.open()
            live.append(member)
        told: dict[int, list[tuple[int, str]]] = {m.id: [] for m in live}  # type: ignore[misc]

        async def collect(member: pgcoord.Member, changes: pgcoord.MemberWatch) -> None:
            async for change in changes:
                if isinstance(change, pgcoord.MemberLeft):
                    told[member.id].append((change.member.id, change.reason))  # type: ignore[index]

        register = psycopg.connect(dsn, autocommit=True)
        if not listening:  # no LISTEN can start (pgcoord.ears_open waits, then gives up)
            register.execute("select pg_catalog.pg_advisory_lock(pgcoord.ears_ns(), "
                             "pgcoord.ears_code('pgcoord_members'))")
        watches = [m.watch() for m in live]
        tasks = [asyncio.create_task(collect(m, w)) for m, w in zip(live, watches, strict=True)]
        await asyncio.sleep(1.0)  # the watches listen, the watchers wait on their targets
        proc.send_signal(signal.SIGKILL)
        # The ring by id: doomed[0], live[0], doomed[1], live[1]; each live member's
        # watcher waits on its successor, the second one's on the first (it wraps).
        targets = {live[0].id: doomed[1], live[1].id: doomed[0]}
        wanted = set(doomed) if listening else None
        async with asyncio.timeout(10):
            while not all((wanted or {targets[m]}) <= {i for i, _ in seen} for m, seen in told.items()):
                await asyncio.sleep(0.02)
        for member_id, seen in told.items():
            assert {why for i, why in seen if i in doomed} == {"crashed"}, (member_id, seen)
        for w in watches:
            w.close()
        for t in tasks:
            t.cancel()
        register.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for m in live:
            await m.close()
