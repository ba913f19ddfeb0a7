"""Issue 22 §4: every DSN that psql accepts works everywhere.

A real role on the test server has the password ``p@/:#%? x``, which a URL carries
percent-encoded. Each path that takes a DSN (the pytest plugin's PGCOORD_TEST_DSN,
the sync twins, the CLI's status, jobs and doctor, the library's own sessions) is
given that URL, and its key=value form, and must log in with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .conftest import sql

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "p@/:#%? x"


@pytest.fixture(scope="module")
def role(dsn: str) -> Iterator[str]:
    """A superuser role whose password has every character a URL must encode."""
    name = f"dsn_{uuid.uuid4().hex[:8]}"
    sql(dsn, f"create role {name} login superuser password '{PASSWORD}'")
    try:
        yield name
    finally:
        sql(dsn, f"drop owned by {name} cascade")
        sql(dsn, f"drop role {name}")


def forms(dsn: str, role: str) -> dict[str, str]:
    """The role's DSN to ``dsn``'s database as a URL and as key=value (libpq's rules)."""
    p = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    url = (f"postgresql://{quote(role, safe='')}:{quote(PASSWORD, safe='')}@{p['host']}:{p['port']}"
           f"/{p['dbname']}")
    return {"url": url, "keyvalue": make_conninfo(host=p["host"], port=p["port"], dbname=p["dbname"],
                                                  user=role, password=PASSWORD)}


def env_without_a_dsn(**extra: str) -> dict[str, str]:
    drop = ("PGCOORD_DSN", "DATABASE_URL", "PGPASSWORD", "PGCOORD_TEST_DSN", "PGSERVICE")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.parametrize("form", ["url", "keyvalue"])
def test_the_pytest_plugin_passes_pgcoord_test_dsn_through(
        dsn: str, role: str, form: str, tmp_path: Path) -> None:
    # Before: the plugin rebuilt the URL from its parts, decoded: "failed to resolve host".
    test = tmp_path / "test_user_suite.py"
    test.write_text(textwrap.dedent("""
        import psycopg

        def test_a_user_test(pgcoord_dsn):
            with psycopg.connect(pgcoord_dsn) as conn:
                user = conn.execute("select current_user").fetchone()[0]
                assert user.startswith("dsn_")
                assert conn.execute("select count(*) from pgcoord.schedules").fetchone() == (0,)
    """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(test),
         "--rootdir", str(tmp_path), "-c", os.devnull],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env=env_without_a_dsn(PGCOORD_TEST_DSN=forms(dsn, role)[form]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("form", ["url", "keyvalue"])
@pytest.mark.parametrize("command", [["status"], ["jobs"], ["doctor"]])
def test_the_cli_logs_in_with_the_dsn_as_given(dsn: str, role: str, form: str, command: list[str]) -> None:
    given = forms(dsn, role)[form]
    result = subprocess.run([sys.executable, "-m", "pgcoord.cli", *command, "--dsn", given],
                            capture_output=True, text=True, timeout=120, env=env_without_a_dsn(),
                            stdin=subprocess.DEVNULL)
    assert "cannot connect" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert result.returncode in ((0, 1) if command == ["doctor"] else (0,)), result.stderr


def test_migrate_logs_in_with_the_url_as_given(dsn: str, role: str) -> None:
    given = forms(dsn, role)["url"]
    result = subprocess.run([sys.executable, "-m", "pgcoord.cli", "migrate", "--dsn", given],
                            capture_output=True, text=True, timeout=120, env=env_without_a_dsn(),
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("form", ["url", "keyvalue"])
def test_the_sync_twins_and_dsn_sessions_log_in_with_the_dsn_as_given(
        dsn: str, role: str, form: str) -> None:
    given = forms(dsn, role)[form]
    from pgcoord import sync

    with sync.LockHolder(given) as holder, holder.lock("dsn-passthrough"):
        pass
    with sync.Member(given, group=f"g-{form}") as member:
        assert member.id is not None
    import asyncio

    from pgcoord import testing

    name = f"dsn-{form}-{uuid.uuid4().hex[:6]}"
    assert asyncio.run(testing.take_leadership(given, name)) >= 1
    assert asyncio.run(testing.release_leadership(given, name)) is True
