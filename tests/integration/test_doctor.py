"""``pgcoord doctor`` against servers set up to pass, and to fail, each check.

The replication checks run against a real primary and standby in test_ha.py
(synchronous: pass) and test_ha_async.py (asynchronous: warn; a standby: fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer
from pgcoord._core.resources import read_sql
from pgcoord.cli.main import main
from pgcoord.cli.doctor import Check, run_checks

from .pgbouncer import PgBouncer

SYNC_ON = "options=-csynchronous_commit%3Don"


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Check]]:
    """Run the command as a user would (--json); its exit status and checks by name."""
    code = main(["doctor", "--json", *args])
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == code
    return code, {c["name"]: Check(**c) for c in doc["checks"]}


def statuses(checks: dict[str, Check]) -> dict[str, str]:
    return {name: c.status for name, c in checks.items()}


def test_a_healthy_database_passes_every_check(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = doctor(capsys, "--dsn", f"{dsn}?{SYNC_ON}")
    assert set(statuses(checks).values()) == {"pass"}, checks
    assert code == 0
    assert set(checks) == {"connect", "server_version", "schema", "privileges", "lock_headroom",
                           "connections", "replication", "synchronous_commit", "clock_skew", "pooler"}
    # The table form says the same.
    assert main(["doctor", "--dsn", f"{dsn}?{SYNC_ON}"]) == 0
    assert "all checks passed" in capsys.readouterr().out


def test_synchronous_commit_off_is_a_warning_with_its_fix(
    dsn: str, capsys: pytest.CaptureFixture[str],
) -> None:
    code, checks = doctor(capsys, "--dsn", dsn)  # the test server runs with it off
    assert code == 1
    assert checks["synchronous_commit"].status == "warn"
    assert "synchronous_commit = on" in checks["synchronous_commit"].fix
    assert main(["doctor", "--dsn", dsn]) == 1
    out = capsys.readouterr().out
    assert "WARN  synchronous_commit" in out and "fix: ALTER ROLE" in out


def test_a_database_without_the_schema_fails(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = doctor(capsys, "--dsn", fresh_db)
    assert code == 2
    assert checks["schema"].status == "fail" and "pgcoord migrate" in checks["schema"].fix


def test_a_schema_behind_head_fails(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    pgcoord.migrations.upgrade(fresh_db, "0001")
    code, checks = doctor(capsys, "--dsn", fresh_db)
    assert code == 2
    assert checks["schema"].status == "fail"
    assert "at revision 0001" in checks["schema"].detail


def test_an_unreachable_database_is_a_failure_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = doctor(capsys, "--dsn", "postgresql://postgres@127.0.0.1:1/nowhere")
    assert code == 2 and statuses(checks) == {"connect": "fail"}


@pytest.fixture
def bare_role(fresh_db: str) -> Iterator[tuple[str, str]]:
    """A login role with no grant at all, in a database with the schema; (role, its DSN)."""
    pgcoord.migrations.upgrade(fresh_db)
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {role} login")
    try:
        yield role, fresh_db.replace("postgres@", f"{role}@")
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity where usename = '{role}'")
            admin.execute(f"drop owned by {role}; drop role {role}")


def test_a_role_without_grants_fails_until_roles_sql_grants_them(
    fresh_db: str, bare_role: tuple[str, str], capsys: pytest.CaptureFixture[str],
) -> None:
    role, role_dsn = bare_role
    code, checks = doctor(capsys, "--dsn", role_dsn)
    assert code == 2
    assert checks["privileges"].status == "fail"
    assert "USAGE on pgcoord" in checks["privileges"].detail
    assert "UPDATE on pgcoord.leases" in checks["privileges"].detail
    # An operator, as superuser, checks the service role by name.
    _, checks = doctor(capsys, "--dsn", fresh_db, "--role", role)
    assert checks["privileges"].status == "fail"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        service_grants = [line for line in read_sql("roles.sql").splitlines()
                          if line.startswith("GRANT") and "pgcoord_service" in line]
        admin.execute("\n".join(service_grants).replace("pgcoord_service", role))
    _, checks = doctor(capsys, "--dsn", role_dsn)
    assert checks["privileges"].status == "pass"
    # The service role may not read the version table: said, not failed.
    assert checks["schema"].status == "warn"
    _, checks = doctor(capsys, "--dsn", fresh_db, "--role", "no_such_role_here")
    assert checks["privileges"].status == "fail"


@pytest.fixture(scope="module")
def cramped() -> Iterator[EmbeddedServer]:
    """Room for 12 connections (9 for non-superusers) and a lock table of 10 x 12 = 120."""
    with EmbeddedServer({"max_connections": "12", "max_locks_per_transaction": "10",
                         "superuser_reserved_connections": "3"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


def test_a_crowded_lock_table_warns_then_fails(cramped: EmbeddedServer,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(cramped.dsn, autocommit=True) as holder:
        holder.execute("select pg_advisory_lock(k) from generate_series(1, 70) as k")
        _, checks = doctor(capsys, "--dsn", cramped.dsn)
        assert checks["lock_headroom"].status == "warn", checks["lock_headroom"]
        assert "70 advisory locks" in checks["lock_headroom"].detail
        assert "max_locks_per_transaction" in checks["lock_headroom"].fix
    _, checks = doctor(capsys, "--dsn", cramped.dsn)
    assert checks["lock_headroom"].status == "pass"
    code, checks = doctor(capsys, "--dsn", cramped.dsn, "--locks", "120")
    assert checks["lock_headroom"].status == "fail" and code == 2


def test_few_free_connections_warn_then_fail(cramped: EmbeddedServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, checks = doctor(capsys, "--dsn", cramped.dsn)
    assert checks["connections"].status == "pass"
    conns = [psycopg.connect(cramped.dsn) for _ in range(7)]  # with doctor's own: 8 of 9
    try:
        _, checks = doctor(capsys, "--dsn", cramped.dsn)
        assert checks["connections"].status == "warn", checks["connections"]
        code, checks = doctor(capsys, "--dsn", cramped.dsn, "--connections", "2")
        assert checks["connections"].status == "fail" and code == 2
        assert "max_connections" in checks["connections"].fix
    finally:
        for conn in conns:
            conn.close()


def test_clock_skew_warns_then_fails(dsn: str) -> None:
    by_name = {c.name: c for c in run_checks(dsn, clock=time.time)}
    assert by_name["clock_skew"].status == "pass"
    ahead = {c.name: c for c in run_checks(dsn, clock=lambda: time.time() + 5)}
    assert ahead["clock_skew"].status == "warn" and "ahead of" in ahead["clock_skew"].detail
    behind = {c.name: c for c in run_checks(dsn, clock=lambda: time.time() - 60)}
    assert behind["clock_skew"].status == "fail" and "NTP" in behind["clock_skew"].fix


def test_a_transaction_mode_pooler_is_a_warning(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    server_port = int(dsn.rsplit(":", 1)[1].split("/")[0])
    for mode, expected in (("transaction", "warn"), ("session", "pass")):
        bouncer = PgBouncer(server_port, pool_mode=mode)
        try:
            _, checks = doctor(capsys, "--dsn", bouncer.dsn(dsn))
        finally:
            bouncer.stop()
        assert checks["pooler"].status == expected, (mode, checks["pooler"])
        assert "pooler" in checks["pooler"].detail


_WITHOUT_PSYCOPG = """
import importlib.util, sys
# As on a machine where only asyncpg is installed: psycopg can be neither found nor imported.
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "psycopg" else found(name, *a)
class NoPsycopg:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "psycopg":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoPsycopg())
from pgcoord.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_internal_error_is_a_failure_not_a_warning(dsn: str) -> None:
    """Exit 1 means "a warning"; doctor failing to run at all (here: a key=value DSN,
    which only psycopg reads, with only asyncpg installed) must exit 2, in one line."""
    params = conninfo_to_dict(dsn)
    key_value = f"host=127.0.0.1 port={params['port']} user=postgres dbname={params['dbname']}"
    run = subprocess.run([sys.executable, "-c", _WITHOUT_PSYCOPG, "doctor", "--dsn", key_value],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "psycopg" in run.stdout + run.stderr and "Traceback" not in run.stderr


def test_a_synchronous_standby_named_but_not_connected_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """synchronous_standby_names set and no such standby streaming: every commit that
    writes waits forever. That is no "no streaming standbys" pass."""
    with EmbeddedServer({"synchronous_standby_names": "replica_b", "max_connections": "12"}) as server:
        code, checks = doctor(capsys, "--dsn", server.dsn)
    assert checks["replication"].status == "fail", checks["replication"]
    assert "replica_b" in checks["replication"].detail
    assert "synchronous_standby_names" in checks["replication"].fix and code == 2


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
def test_a_sqlalchemy_multi_host_url_reaches_the_server(dsn: str, driver: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The form docs/operations.md gives for SQLAlchemy, first host dead."""
    params = conninfo_to_dict(dsn)
    url = (f"postgresql+{driver}://postgres@/{params['dbname']}?host=127.0.0.1:1"
           f"&host=127.0.0.1:{params['port']}&target_session_attrs=read-write")
    _, checks = doctor(capsys, "--dsn", url)
    assert checks["connect"].status == "pass", checks["connect"]
    assert checks["schema"].status == "pass"


def _start_walsender(dsn: str, kind: str, command: bytes,
                     name: str) -> psycopg.Connection[tuple[object, ...]]:
    """A real walsender streaming (a replication connection that sent START_REPLICATION):
    what a logical subscriber or a WAL archiver such as pg_receivewal looks like."""
    conn = psycopg.connect(f"{dsn}?replication={kind}&application_name={name}", autocommit=True)
    conn.pgconn.send_query(command)
    return conn


def _wait_walsenders(dsn: str, count: int) -> None:
    deadline = time.monotonic() + 10
    with psycopg.connect(dsn, autocommit=True) as conn:
        while conn.execute("select count(*) from pg_stat_replication").fetchone() != (count,):
            assert time.monotonic() < deadline, "the walsender did not start"
            time.sleep(0.05)


def test_a_logical_subscriber_is_no_standby(capsys: pytest.CaptureFixture[str]) -> None:
    """Logical walsenders are in pg_stat_replication too, as asynchronous: no standby
    can be promoted from them, so doctor says nothing about them."""
    with EmbeddedServer({"wal_level": "logical", "max_wal_senders": "4", "max_replication_slots": "4",
                         "max_connections": "12"}) as server:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute("create publication doctor_pub for all tables")
            admin.execute("select pg_create_logical_replication_slot('doctor_slot', 'pgoutput')")
        subscriber = _start_walsender(server.dsn, "database", b"START_REPLICATION SLOT doctor_slot LOGICAL"
                                      b" 0/0 (proto_version '1', publication_names 'doctor_pub')",
                                      "a_subscriber")
        try:
            _wait_walsenders(server.dsn, 1)
            _, checks = doctor(capsys, "--dsn", server.dsn)
        finally:
            subscriber.close()
    assert checks["replication"].status == "pass", checks["replication"]
    assert checks["replication"].detail == "no streaming standbys"


def test_synchronous_commit_is_read_for_the_role_checked(
    fresh_db: str, bare_role: tuple[str, str], capsys: pytest.CaptureFixture[str],
) -> None:
    """ALTER ROLE ... SET synchronous_commit = off on the service role: doctor run by an
    operator with --role must see it, not the operator's own session's setting."""
    role, _ = bare_role
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"alter role {role} set synchronous_commit = off")
    _, checks = doctor(capsys, "--dsn", f"{fresh_db}?{SYNC_ON}", "--role", role)
    assert checks["synchronous_commit"].status == "warn", checks["synchronous_commit"]
    assert role in checks["synchronous_commit"].detail
    _, checks = doctor(capsys, "--dsn", f"{fresh_db}?{SYNC_ON}")  # the operator's own: on
    assert checks["synchronous_commit"].status == "pass"
