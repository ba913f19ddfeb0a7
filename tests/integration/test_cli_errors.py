"""Operator mistakes at the ``pgcoord`` command: one line on stderr, a distinct exit code.

Each test runs the real command in a subprocess against the real test server
(or a closed port, or a socket that never answers). The exit codes are part of
the interface: 2 usage, 3 cannot connect, 4 schema missing, 5 no privilege.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import psycopg
import pytest

import pgcoord.migrations as migrations

from .conftest import Server, sql

USAGE, CANNOT_CONNECT, SCHEMA_MISSING, NO_PRIVILEGE = 2, 3, 4, 5
NOT_FOUND = 6


def _env() -> dict[str, str]:
    """The caller's environment without anything that would choose a database."""
    drop = ("PGCOORD_DSN", "DATABASE_URL", "PGHOST", "PGPORT", "PGUSER", "PGPASSWORD",
            "PGDATABASE", "PGCONNECT_TIMEOUT", "PGSERVICE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "COLUMNS": "80"}


def pgcoord(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgcoord.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(), stdin=subprocess.DEVNULL)


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pgcoord.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), stdin=subprocess.DEVNULL)


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single stderr line of a failed run that exited with ``code``."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgcoord: "), result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nobody listens there now


def with_db(dsn: str, *, user: str | None = None, password: str | None = None,
            dbname: str | None = None) -> str:
    """``dsn`` with another user, password or database."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    auth = quote(user or str(params["user"]))
    if password:
        auth += ":" + quote(password)
    return (f"postgresql://{auth}@{params['host']}:{params['port']}/"
            f"{dbname or params['dbname']}")


# -- the schema is missing ---------------------------------------------------------------

def test_status_without_the_schema_exits_4_in_one_line(fresh_db: str) -> None:
    result = pgcoord("status", "--dsn", fresh_db)
    line = one_line(result, SCHEMA_MISSING)
    assert "pgcoord migrate" in line
    assert result.stdout == ""


def test_debug_keeps_the_traceback_and_the_exit_code(fresh_db: str) -> None:
    for args in (("--debug", "status", "--dsn", fresh_db), ("status", "--dsn", fresh_db, "--debug")):
        result = pgcoord(*args)
        assert result.returncode == SCHEMA_MISSING, result.stderr
        assert "Traceback" in result.stderr and "SchemaMissing" in result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("pgcoord: pgcoord's schema is not installed")


def test_a_schema_newer_than_this_pgcoord_exits_4(fresh_db: str) -> None:
    migrations.upgrade(fresh_db)
    sql(fresh_db, "update pgcoord.alembic_version set version_num = '9999'")
    line = one_line(pgcoord("migrate", "--dsn", fresh_db), SCHEMA_MISSING)
    assert "9999" in line and "upgrade the pgcoord package" in line


# -- cannot connect ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["status", "migrate"])
def test_a_refused_connection_exits_3(command: str) -> None:
    port = closed_port()
    line = one_line(pgcoord(command, "--dsn", f"postgresql://postgres@127.0.0.1:{port}/app"),
                    CANNOT_CONNECT)
    assert f"127.0.0.1:{port}" in line and "--dsn" in line


@pytest.fixture
def password_role(pg_server: Server, dsn: str) -> Iterator[tuple[str, str]]:
    """A role that must log in with a password: pg_hba.conf gets a scram line for it
    in front of the test server's trust lines, and is put back afterwards."""
    role, password = f"pw_{uuid.uuid4().hex[:8]}", "right-password"
    admin = with_db(dsn, dbname="postgres")
    sql(admin, f"create role {role} login password '{password}'")
    (hba,) = sql(admin, "select setting from pg_settings where name = 'hba_file'")[0]
    (original,) = sql(admin, "select pg_read_binary_file(%s)", hba)[0]
    lines = f"host all {role} 127.0.0.1/32 scram-sha-256\nhost all {role} ::1/128 scram-sha-256\n"

    def write_hba(content: bytes) -> None:
        # lo_export writes the bytes as the server's own user, so this works on a
        # server the tests did not start too (PGCOORD_TEST_DSN, a superuser).
        with psycopg.connect(admin, autocommit=True) as conn:
            (oid,) = conn.execute("select lo_from_bytea(0, %s)", (content,)).fetchone()  # type: ignore[misc]
            conn.execute("select lo_export(%s, %s), lo_unlink(%s)", (oid, hba, oid))
            conn.execute("select pg_reload_conf()")
        time.sleep(0.3)  # the postmaster rereads the file on SIGHUP

    write_hba(lines.encode() + bytes(original))
    try:
        yield role, password
    finally:
        write_hba(bytes(original))
        sql(admin, f"drop role {role}")


@pytest.mark.parametrize("command", ["migrate", "status"])
def test_a_refused_login_exits_3_and_says_which_part_of_the_dsn_to_check(
    command: str, dsn: str, password_role: tuple[str, str],
) -> None:
    role, password = password_role
    cases = {
        "unknown role": (with_db(dsn, user="nobody_here"), 'role "nobody_here" does not exist'),
        "bad password": (with_db(dsn, user=role, password="wrong"), "password authentication failed"),
        "no password": (with_db(dsn, user=role), "password"),
        "unknown database": (with_db(dsn, dbname="no_such_db"), 'database "no_such_db" does not exist'),
    }
    for label, (url, server_says) in cases.items():
        line = one_line(pgcoord(command, "--dsn", url), CANNOT_CONNECT)
        assert server_says in line, (label, line)
        assert "wrong" not in line, "a password must never be printed"
    # the role itself is fine with the right password
    ok = pgcoord(command, "--dsn", with_db(dsn, user=role, password=password))
    assert "cannot connect" not in ok.stderr, ok.stderr


def test_a_server_that_never_answers_exits_3_within_the_connect_timeout() -> None:
    """libpq waits for ever by default; the command gives up after 10 s."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts TCP, never says a word
        port = silent.getsockname()[1]
        results: dict[str, tuple[float, subprocess.CompletedProcess[str]]] = {}

        def run(command: str) -> None:
            started = time.monotonic()
            result = pgcoord(command, "--dsn", f"postgresql://postgres@127.0.0.1:{port}/app", timeout=60)
            results[command] = (time.monotonic() - started, result)

        threads = [threading.Thread(target=run, args=(c,)) for c in ("status", "migrate")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert set(results) == {"status", "migrate"}, "a command did not end within 60 s"
    for command, (took, result) in results.items():
        line = one_line(result, CANNOT_CONNECT)
        assert took < 30, (command, took)
        assert f"127.0.0.1:{port}" in line


# -- usage -----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["status", "migrate"])
@pytest.mark.parametrize("bad_dsn", [
    "localhost",                                   # no scheme, no key=value
    "mysql://app:secret@db/app",                   # another database's URL
    "postgresql://app:secret@127.0.0.1:54x2/app",  # a port that is no number
    "host=127.0.0.1 port=abc dbname=app",          # the same as key=value
])
def test_a_malformed_dsn_exits_2(command: str, bad_dsn: str) -> None:
    line = one_line(pgcoord(command, "--dsn", bad_dsn), USAGE)
    assert "--dsn" in line and "secret" not in line


def test_no_dsn_and_an_unknown_revision_exit_2() -> None:
    line = one_line(pgcoord("status"), USAGE)
    assert "--dsn" in line and "PGCOORD_DSN" in line
    line = one_line(pgcoord("migrate", "--revision", "0999", "--dsn", "postgresql://x@127.0.0.1/x"), USAGE)
    assert "unknown revision '0999'" in line and migrations.head() in line


def test_help_lists_the_exit_codes() -> None:
    result = pgcoord("--help")
    assert result.returncode == 0
    for code, meaning in ((2, "usage"), (3, "cannot connect"), (4, "schema"), (5, "privilege")):
        assert any(line.split()[:1] == [str(code)] and meaning in line
                   for line in result.stdout.splitlines()), result.stdout


def test_an_unknown_schedule_exits_6_not_as_a_usage_error(dsn: str) -> None:
    """2 means the command line is wrong; a name that names no schedule is not."""
    missing = f"missing:{uuid.uuid4().hex[:6]}"
    for action in ("pause", "resume", "trigger", "history"):
        line = one_line(pgcoord("jobs", action, missing, "--dsn", dsn), NOT_FOUND)
        assert "no schedule named" in line and missing in line
    assert any(line.split()[:1] == ["6"] and "no such" in line
               for line in pgcoord("--help").stdout.splitlines())


# -- privileges --------------------------------------------------------------------------

def test_a_role_without_the_privilege_exits_5(fresh_db: str, dsn: str) -> None:
    role = f"weak_{uuid.uuid4().hex[:8]}"
    sql(fresh_db, f"create role {role} login")
    try:
        # migrate needs CREATE on the database; status needs the operator grants
        line = one_line(pgcoord("migrate", "--dsn", with_db(fresh_db, user=role)), NO_PRIVILEGE)
        assert "permission denied" in line
        assert migrations.current(fresh_db) is None
        line = one_line(pgcoord("status", "--dsn", with_db(dsn, user=role)), NO_PRIVILEGE)
        assert "permission denied" in line and "roles.sql" in line
    finally:
        sql(fresh_db, f"drop role {role}")


# -- other things an operator meets ----------------------------------------------------

def test_downgrade_of_an_empty_database_leaves_it_empty(fresh_db: str) -> None:
    result = pgcoord("migrate", "--dsn", fresh_db, "--downgrade", "base")
    assert result.returncode == 0, result.stderr
    assert "nothing to do" in result.stdout
    assert sql(fresh_db, "select 1 from pg_namespace where nspname = 'pgcoord'") == []


def test_status_takes_a_sqlalchemy_url(dsn: str) -> None:
    result = pgcoord("status", "--dsn", dsn.replace("postgresql://", "postgresql+psycopg://"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("KIND")


def test_a_reader_that_goes_away_gets_no_traceback() -> None:
    proc = spawn("migrate", "--sql")
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -1` before the DDL is written
    stderr = proc.stderr.read()
    proc.wait(60)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


class _Lines:
    """The lines a process prints, collected by a thread as they come."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.append(line)

    def wait_for(self, text: str, *, after: int = 0, timeout: float = 30) -> int:
        """Index of the first line from ``after`` on that contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if text in self.lines[i]:
                    return i
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not printed; got {self.lines[after:]!r}")


def test_watch_carries_on_through_refused_connections_and_ends_quietly_on_ctrl_c(fresh_db: str) -> None:
    migrations.upgrade(fresh_db)
    dbname = fresh_db.rsplit("/", 1)[1]
    admin = with_db(fresh_db, dbname="postgres")
    proc = spawn("status", "--dsn", fresh_db, "--watch", "0.2")
    out = _Lines(proc.stdout)
    try:
        first = out.wait_for("KIND")
        sql(admin, f"alter database {dbname} allow_connections false")
        refused = out.wait_for("cannot connect", after=first)
        sql(admin, f"alter database {dbname} allow_connections true")
        out.wait_for("KIND", after=refused)
        assert proc.poll() is None, "the watch must go on"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        sql(admin, f"alter database {dbname} allow_connections true")
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr


def test_watch_as_json_prints_one_document_per_line(dsn: str) -> None:
    proc = spawn("status", "--dsn", dsn, "--watch", "0.2", "--json")
    out = _Lines(proc.stdout)
    try:
        out.wait_for("]", after=1)  # a second refresh, so two lines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    docs = [json.loads(line) for line in out.lines[:2]]
    assert all(isinstance(doc, list) for doc in docs), out.lines[:2]


def test_a_missing_extra_is_named_with_the_pip_command() -> None:
    """As if pgcoord were installed without the migrate extra: alembic cannot be imported."""
    code = ("import sys; sys.modules['alembic'] = None; from pgcoord.cli import main; "
            "sys.exit(main(['migrate', '--dsn', 'postgresql://app@127.0.0.1/app']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=_env())
    line = one_line(result, 1)
    assert "pip install 'pgcoord[migrate]'" in line
