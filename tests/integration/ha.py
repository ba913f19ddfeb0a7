"""A primary and a streaming standby on loopback, for the high-availability tests
and ``bench/ha.py``.

The standby is a ``pg_basebackup`` of the primary, with ``pg_basebackup`` and
``pg_ctl`` from the server's own bindir (``PGCOORD_PG_BINDIR``, else the machine's;
.ci/servers.py puts them beside CI's PostgreSQL 14, whose wheel lacks
``pg_basebackup``), streaming from it. With
``synchronous=True`` the primary names it in ``synchronous_standby_names`` and
commits with ``synchronous_commit=on``, so no commit is acknowledged before the
standby has it: what a failover to it may not lose. With ``synchronous=False``
the primary does not wait, and ``through_proxy=True`` lets a test hold the WAL back
on its way (``cut_replication()``): a lag as long as the test needs.

``fail_over()`` is what an operator or Patroni does when the primary's host dies:
the primary stops at once (SIGQUIT, an immediate shutdown: no checkpoint, every
session cut) and the standby is promoted with ``pg_ctl promote``. The clients
find the new primary through a multi-host DSN that lists both servers with
``target_session_attrs=read-write``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pgcoord._core.embedded import EmbeddedServer

from .proxy import FreezableProxy

STANDBY_NAME = "standby1"

# Durability on, like a real deployment's: the point is what a failover keeps.
_COMMON = {"synchronous_commit": "on", "fsync": "on", "full_page_writes": "on",
           "wal_level": "replica", "max_wal_senders": "4", "max_connections": "200",
           "shared_buffers": "32MB", "wal_sender_timeout": "5s",
           "wal_receiver_status_interval": "1s"}


def _tool(server: EmbeddedServer, name: str) -> Path:
    """``name`` from the server's bindir (a newer pg_basebackup works with an older
    server, which is how CI's PostgreSQL 14 gets one)."""
    path = server.bindir / name
    if not path.is_file():
        raise RuntimeError(f"{path} not found: the HA tests need {name} beside the server")
    return path


class StandbyPair:
    """A primary and one streaming standby; ``stop()`` removes both."""

    def __init__(self, *, synchronous: bool = True, through_proxy: bool = False) -> None:
        self.synchronous = synchronous
        # Replication through a proxy that can go silent: WAL the standby never
        # received is what an asynchronous failover loses.
        self.through_proxy = through_proxy
        self.proxy: FreezableProxy | None = None
        primary = {**_COMMON}
        if synchronous:
            primary["synchronous_standby_names"] = STANDBY_NAME
        # The standby's own settings must not name a synchronous standby: once
        # promoted it has none, and every commit would wait for ever.
        standby = {**_COMMON, "hot_standby": "on"}
        self.primary = EmbeddedServer(primary)
        self.standby = EmbeddedServer(standby)
        self.promoted = False

    # -- DSNs that follow the primary ------------------------------------------------

    def libpq_dsn(self, dbname: str = "postgres") -> str:
        """The key=value form, for psycopg (libpq)."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
                f"user=postgres dbname={dbname} target_session_attrs=read-write connect_timeout=3")

    def url(self, dbname: str = "postgres", scheme: str = "postgresql") -> str:
        """The URL form: libpq and asyncpg read the same multi-host URL."""
        return (f"{scheme}://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
                f"/{dbname}?target_session_attrs=read-write")

    def sqlalchemy_url(self, dbname: str = "postgres", driver: str = "asyncpg") -> str:
        """SQLAlchemy's multi-host form: one ``host=`` query parameter per server."""
        return (f"postgresql+{driver}://postgres@/{dbname}?host=127.0.0.1:{self.primary.port}"
                f"&host=127.0.0.1:{self.standby.port}&target_session_attrs=read-write")

    def current(self) -> EmbeddedServer:
        """The server that takes writes now."""
        return self.standby if self.promoted else self.primary

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> StandbyPair:
        self.primary.start()
        upstream = self.primary.port
        if self.through_proxy:
            self.proxy = FreezableProxy("127.0.0.1", self.primary.port)
            upstream = self.proxy.port
        standby = self.standby
        user = standby._user
        if user is not None:
            os.chown(standby._root, user.pw_uid, user.pw_gid)
        subprocess.run(
            [str(_tool(standby, "pg_basebackup")), "-D", str(standby.datadir), "-X", "stream", "-R",
             "-c", "fast", "--no-sync", "-d",
             f"host=127.0.0.1 port={upstream} user=postgres application_name={STANDBY_NAME}"],
            check=True, capture_output=True, cwd=standby._root,
            **standby._as_server_user(),  # type: ignore[call-overload]
        )
        standby._spawn()
        self.wait_streaming()
        return self

    def wait_streaming(self, timeout: float = 30.0) -> None:
        """Until the primary sees the standby streaming (and, synchronous, as its sync one)."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
                row = conn.execute("select state, sync_state from pg_stat_replication"
                                   " where application_name = %s", (STANDBY_NAME,)).fetchone()
            if row == ("streaming", want):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the standby is not streaming ({want}) after {timeout}s:\n"
                           f"{self.standby.log_tail()}")

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed everything the primary wrote so far."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            lsn = conn.execute("select pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
                done = conn.execute("select pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()
            if done == (True,):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the standby did not replay up to {lsn} in {timeout}s")

    def cut_replication(self) -> None:
        """From now on the standby receives nothing (``through_proxy`` only): the
        primary goes on committing what the standby will never have."""
        assert self.proxy is not None, "StandbyPair(through_proxy=True) for this"
        self.proxy.freeze()

    def kill_primary(self) -> None:
        """An immediate shutdown: every session cut, nothing flushed that was not."""
        self.primary._shutdown(signal.SIGQUIT)

    def promote(self, timeout: float = 30.0) -> None:
        """``pg_ctl promote``, then wait until the standby takes writes. pg_ctl's own
        wait (-w) polls every 100 ms; this looks every 5 ms, so that the moment it
        returns is the moment clients can write (bench/ha.py's baseline)."""
        subprocess.run([str(_tool(self.standby, "pg_ctl")), "promote", "-W",
                        "-D", str(self.standby.datadir)],
                       check=True, capture_output=True, cwd=self.standby._root,
                       **self.standby._as_server_user())  # type: ignore[call-overload]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
            while conn.execute("select pg_is_in_recovery()").fetchone() != (False,):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby was not promoted in {timeout}s:\n"
                                       f"{self.standby.log_tail()}")
                time.sleep(0.005)
        self.promoted = True

    def fail_over(self) -> None:
        self.kill_primary()
        self.promote()

    def stop(self) -> None:
        # Each one is stopped even if stopping another raised.
        try:
            self.standby.stop()
        finally:
            try:
                self.primary.stop()
            finally:
                if self.proxy is not None:
                    self.proxy.close()

    def __enter__(self) -> StandbyPair:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- the replicas ------------------------------------------------------------------------

REPLICA = str(Path(__file__).with_name("ha_replica.py"))
DRIVERS = ("asyncpg", "psycopg", "sqlalchemy")


@dataclass
class Event:
    at: float  # unix time, from the replica's clock (the same machine)
    what: str
    name: str
    fence: str
    replica: str


class Fleet:
    """Three ``ha_replica.py`` processes, one per driver, on a pair's multi-host DSNs."""

    def __init__(self, pair: Any, dbname: str, ttl: float, *, member_features: bool = False) -> None:
        # pair: a StandbyPair, or anything with its DSN methods (tests/ha_patroni).
        self.pair, self.dbname, self.ttl = pair, dbname, ttl
        self.member_features = member_features
        self.prefix = f"ha:{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: dict[str, list[str]] = {}
        self.query("create table if not exists ha_writes (id bigserial primary key, name text,"
                   " replica text, fence bigint, at timestamptz default clock_timestamp())")
        self.query("create table if not exists ha_starts (id bigserial primary key,"
                   " slot_at timestamptz, runner text)")
        try:
            self._spawn()
        except BaseException:
            self.stop()  # the replicas already started
            raise

    def _spawn(self) -> None:
        pair, dbname, ttl = self.pair, self.dbname, self.ttl
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
               "HA_REPLICA_MEMBER_FEATURES": "1" if self.member_features else "0"}
        for i, driver in enumerate(DRIVERS):
            label = f"r{i}-{driver}"
            pool_dsn = {"asyncpg": pair.url(dbname), "psycopg": pair.libpq_dsn(dbname),
                        "sqlalchemy": pair.sqlalchemy_url(dbname, "psycopg")}[driver]
            direct = pair.libpq_dsn(dbname) if driver == "psycopg" else pair.url(dbname)
            proc = subprocess.Popen(
                [sys.executable, REPLICA, driver, pool_dsn, direct, self.prefix, label, str(ttl)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            self.procs[label] = proc
            lines: list[str] = []
            self.lines[label] = lines
            threading.Thread(target=lambda p=proc, out=lines: [out.append(s.strip()) for s in p.stdout],  # type: ignore[union-attr, misc]
                             daemon=True).start()

    def name(self, feature: str) -> str:
        return f"{self.prefix}:{feature}"

    def query(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """On whichever server takes writes now, through the multi-host DSN."""
        with psycopg.connect(self.pair.libpq_dsn(self.dbname), autocommit=True) as conn:
            cur = conn.execute(sql, params or None)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description else []

    def events(self, what: str | None = None, name: str | None = None) -> list[Event]:
        found = []
        for label, lines in self.procs_lines():
            for line in lines:
                if not line.startswith("EVENT "):
                    continue
                _, at, w, n, fence = line.split(" ", 4)
                if (what is None or w == what) and (name is None or n == name):
                    found.append(Event(float(at), w, n, fence, label))
        return sorted(found, key=lambda e: e.at)

    def procs_lines(self) -> list[tuple[str, list[str]]]:
        return [(label, list(lines)) for label, lines in self.lines.items()]

    def wait_for(self, what: str, name: str, *, after: float = 0.0, count: float = 1,
                 timeout: float = 30.0) -> list[Event]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(what, name) if e.at > after]
            if len(found) >= count:
                return found
            if any(p.poll() is not None for p in self.procs.values()):
                raise AssertionError(f"a replica exited: {self.output()}")
            time.sleep(0.02)
        raise AssertionError(f"no {count} x {what} {name} after {after} within {timeout}s:\n"
                             f"{self.output()}")

    def states(self) -> dict[str, dict[str, Any]]:
        """What each replica believes it holds right now (SIGUSR1, one STATE line each)."""
        before = {label: len(lines) for label, lines in self.lines.items()}
        for proc in self.procs.values():
            proc.send_signal(signal.SIGUSR1)
        found: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 5
        while len(found) < len(self.procs) and time.monotonic() < deadline:
            for label, lines in self.lines.items():
                for line in lines[before[label]:]:
                    if line.startswith("STATE "):
                        found[label] = json.loads(line[6:])
            time.sleep(0.02)
        assert len(found) == len(self.procs), self.output()
        return found

    def output(self) -> str:
        return "\n".join(f"{label}: {line}" for label, lines in self.procs_lines()
                         for line in lines if not line.startswith("EVENT ")) or "(no output)"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(8)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
