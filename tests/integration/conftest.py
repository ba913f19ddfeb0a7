"""A real PostgreSQL for the integration tests.

By default the tests start a throwaway server from the binaries on the machine
(as the ``postgres`` user when run as root, since initdb refuses root). Set
PGCOORD_TEST_DSN to a superuser URL of an existing server to use that instead.
No test skips for lack of a server: a missing server is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql.janitor import DatabaseJanitor

import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer


@dataclass
class Server:
    """Where the test server is and how to reach a database on it."""

    params: dict[str, str]
    embedded: EmbeddedServer | None

    def dsn(self, dbname: str) -> str:
        p = dict(self.params)
        p["dbname"] = dbname
        user = p.get("user", "postgres")
        auth = user + (f":{p['password']}" if p.get("password") else "")
        return f"postgresql://{auth}@{p.get('host', '127.0.0.1')}:{p.get('port', '5432')}/{dbname}"

    def janitor(self, dbname: str) -> DatabaseJanitor:
        return DatabaseJanitor(
            user=self.params.get("user", "postgres"), host=self.params.get("host", "127.0.0.1"),
            port=self.params.get("port", "5432"), password=self.params.get("password"),
            dbname=dbname,
        )


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    external = os.environ.get("PGCOORD_TEST_DSN")
    if external:
        params = {k: str(v) for k, v in conninfo_to_dict(external).items()}
        with psycopg.connect(make_conninfo(external)) as conn:
            conn.execute("select 1")
        yield Server(params, None)
        return
    server = EmbeddedServer().start()
    try:
        yield Server({"host": "127.0.0.1", "port": str(server.port), "user": "postgres"}, server)
    finally:
        server.stop()


def migrated_database(pg_server: Server, prefix: str,
                      settings: dict[str, str] | None = None) -> Iterator[str]:
    """A database of its own with pgcoord's schema at head, carrying ``settings``
    (``ALTER DATABASE ... SET``); its sessions are ended before it is dropped. For
    ``yield from`` in a fixture."""
    dbname = f"{prefix}_{uuid.uuid4().hex[:8]}"
    janitor = pg_server.janitor(dbname)
    janitor.init()
    url = pg_server.dsn(dbname)
    pgcoord.migrations.upgrade(url)
    if settings:
        with psycopg.connect(url, autocommit=True) as conn:
            for name, value in settings.items():
                conn.execute(f"ALTER DATABASE {dbname} SET {name} = '{value}'")
    try:
        yield url
    finally:
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as conn:
            conn.execute("select pg_terminate_backend(pid) from pg_stat_activity where datname = %s",
                         (dbname,))
        janitor.drop()


@pytest.fixture(scope="session")
def dsn(pg_server: Server) -> Iterator[str]:
    """A database with pgcoord's schema at head, shared by the session."""
    yield from migrated_database(pg_server, "pgcoord_test")


@pytest.fixture
def fresh_db(pg_server: Server) -> Iterator[str]:
    """An empty database of its own, dropped afterwards."""
    dbname = f"pgcoord_fresh_{uuid.uuid4().hex[:8]}"
    janitor = pg_server.janitor(dbname)
    janitor.init()
    try:
        yield pg_server.dsn(dbname)
    finally:
        janitor.drop()


def advisory_locks(dsn: str) -> list[tuple[int, int, bool]]:
    """(pid, key, granted) for every advisory lock in the database of ``dsn``, but the
    register of listeners (``pgcoord.ears_open``, 0010: a session that LISTENs to a
    pgcoord channel holds one, which tells nothing of what a feature holds)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "select pid, (classid::bigint << 32) | objid::bigint, granted from pg_locks"
            " where locktype = 'advisory' and database ="
            " (select oid from pg_database where datname = current_database())"
            " and pid <> pg_backend_pid()"
            " and not (objsubid = 2 and classid = 1885823854::oid)"
        ).fetchall()


# What a process killed by a test held is freed by the server, not by the process:
# a backend in a statement (a sleep, a lock queue) sees its client gone only at its
# next client_connection_check_interval (pgcoord sets a second). The next test on the
# shared database would find those locks and blame itself.
LOCKS_OF_THE_DEAD_GO_WITHIN = 5.0


@pytest.fixture(autouse=True)
def no_lock_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the shared database (``dsn``), waits until no advisory
    lock is held or awaited there, and fails the test if one still is after
    ``LOCKS_OF_THE_DEAD_GO_WITHIN`` seconds: a leaked lock fails the test that
    leaked it, not the one that runs next."""
    yield
    if "dsn" not in request.fixturenames:
        return
    dsn = request.getfixturevalue("dsn")
    deadline = time.monotonic() + LOCKS_OF_THE_DEAD_GO_WITHIN
    while left := advisory_locks(dsn):
        if time.monotonic() > deadline:
            pytest.fail(f"advisory locks held {LOCKS_OF_THE_DEAD_GO_WITHIN} s after the test: {left}")
        time.sleep(0.02)


@pytest.fixture
def locks_in(dsn: str) -> Iterator[None]:
    """Fails the test if it leaves any advisory lock behind."""
    yield
    assert advisory_locks(dsn) == []


def sql(dsn: str, statement: str, *params: object) -> list[tuple[object, ...]]:
    """Run one statement in autocommit; its rows, if it returns any."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(statement, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def setting_seconds(dsn: str, name: str) -> float | None:
    """A timeout setting (``lock_timeout``, ``statement_timeout``, ...) as the server,
    database or role leave it for a new session of ``dsn``, in seconds; None when off.
    For tests whose bounds a production-like setting changes (the settings suite)."""
    rows = sql(dsn, "select setting::float8, unit from pg_settings where name = %s", name)
    if not rows or not rows[0][0]:
        return None
    value, unit = float(rows[0][0]), rows[0][1]  # type: ignore[arg-type]
    return value / 1000 if unit == "ms" else value


def backends_of(dsn: str, *apps: str) -> list[int]:
    """The pids of the backends whose application_name is one of ``apps``."""
    return [int(p) for (p,) in sql(  # type: ignore[call-overload]
        dsn, "select pid from pg_stat_activity where application_name = any(%s)", list(apps))]


async def seconds_until_gone(dsn: str, apps: list[str], pids: list[int], timeout: float = 10.0) -> float:
    """Seconds until no backend of ``apps`` is left and ``pids`` hold or await no lock
    (fails after ``timeout``): how long a closed object's sessions outlive it."""
    started = time.monotonic()
    while backends_of(dsn, *apps) or sql(
            dsn, "select 1 from pg_locks where pid = any(%s) limit 1", pids):
        assert time.monotonic() - started < timeout, f"backends of {apps} still there after {timeout} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def ring_then_take(dsn: str, name: str, taken: list[object]) -> None:
    """A contender blocked on the lease's doorbell that takes the lease over the moment
    it gets the bell (lease_acquire takes over a row whose holder's session no longer
    holds its doorbell), in one call: no client round trip in between. Its fence (or
    None) is appended to `taken`. Run it in a thread."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""
            CREATE FUNCTION pg_temp.ring_then_take(lease text) RETURNS bigint
                LANGUAGE plpgsql AS $$
                BEGIN
                    PERFORM pg_catalog.pg_advisory_lock(pgcoord.lease_doorbell_key(lease));
                    RETURN (SELECT a.fence FROM pgcoord.lease_acquire(
                        lease, 'contender', 30000, pg_catalog.pg_backend_pid()) AS a);
                END $$""")
        row = conn.execute("SELECT pg_temp.ring_then_take(%s)", (name,)).fetchone()
        taken.append(row[0] if row else None)


def doorbell_waiters(dsn: str, name: str) -> int:
    """How many sessions wait on the lease's doorbell."""
    return int(sql(dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                        " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint)"
                        " = pgcoord.lease_doorbell_key(%s)", name)[0][0])  # type: ignore[call-overload]


@contextlib.contextmanager
def semaphore_held_in_a_thread(dsn: str, name: str) -> Iterator[threading.Event]:
    """The one slot of semaphore ``name`` held by another session, on a thread of its
    own, until the event yielded is set (or the block ends)."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with psycopg.connect(dsn) as conn, pgcoord.semaphore(conn, name, limit=1):
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        yield release
    finally:
        release.set()
        thread.join(10)


@pytest.fixture
def room_for_lock_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lock metrics label only the first names a process uses (LOCK_NAMES_LABELLED);
    a test worker uses hundreds. A test that reads a name's own series starts
    with none labelled yet."""
    from pgcoord.observability import metrics

    monkeypatch.setattr(metrics, "_labelled", set())


def unique(prefix: str) -> str:
    """A name no other test uses: tests share one database."""
    return f"{prefix}:{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def pgcoord_server(pg_server: Server) -> dict[str, str]:
    """pgcoord.testing's fixtures make their databases on this suite's server."""
    p = pg_server.params
    return {"host": p.get("host", "127.0.0.1"), "port": p.get("port", "5432"),
            "user": p.get("user", "postgres"), "password": p.get("password", "")}
