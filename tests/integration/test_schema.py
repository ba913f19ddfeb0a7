"""Installing pgcoord's schema: migrate, downgrade, --sql parity, concurrency, lock_key in SQL."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

import pgcoord
import pgcoord.migrations as migrations
from pgcoord._core.embedded import find_bindir

from .conftest import Server

VECTORS = json.loads((Path(__file__).parent.parent / "key-vectors.json").read_text())["vectors"]


def pgcoord_objects(dsn: str) -> list[tuple[str, str]]:
    """Every object in schema pgcoord, as (kind, name)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            """
            select 'schema', nspname from pg_namespace where nspname = 'pgcoord'
            union all
            select 'relation:' || c.relkind::text, c.relname from pg_class c
              join pg_namespace n on n.oid = c.relnamespace where n.nspname = 'pgcoord'
            union all
            select 'function', p.proname from pg_proc p
              join pg_namespace n on n.oid = p.pronamespace where n.nspname = 'pgcoord'
            order by 1, 2
            """
        ).fetchall()
    return [(str(a), str(b)) for a, b in rows]


def schema_dump(dsn: str) -> list[str]:
    """pg_dump of schema pgcoord, without comments and the version row."""
    out = subprocess.run(
        [str(find_bindir() / "pg_dump"), "--schema-only", "--schema=pgcoord", "--no-owner", dsn],
        check=True, capture_output=True, text=True,
    ).stdout
    return [line for line in out.splitlines() if line.strip() and not line.startswith(("--", "\\restrict", "\\unrestrict"))]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgcoord.cli", *args], capture_output=True, text=True, timeout=120,
    )


def test_migrate_twice_is_a_no_op_and_downgrade_to_base_removes_everything(fresh_db: str) -> None:
    first = run_cli("migrate", "--dsn", fresh_db)
    assert first.returncode == 0, first.stderr
    assert f"base -> {migrations.head()}" in first.stdout
    installed = pgcoord_objects(fresh_db)
    assert ("view", "holders") not in installed  # sanity of the helper's kinds
    assert ("relation:v", "holders") in installed
    assert ("relation:r", "lock_names") in installed
    assert ("relation:r", "alembic_version") in installed
    assert ("function", "lock_key") in installed

    second = run_cli("migrate", "--dsn", fresh_db)
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stdout
    assert pgcoord_objects(fresh_db) == installed

    down = run_cli("migrate", "--dsn", fresh_db, "--downgrade", "base")
    assert down.returncode == 0, down.stderr
    assert pgcoord_objects(fresh_db) == []
    assert migrations.current(fresh_db) is None


def test_the_printed_sql_builds_the_same_schema_as_migrate(pg_server: Server, fresh_db: str) -> None:
    migrations.upgrade(fresh_db)
    printed = run_cli("migrate", "--sql")
    assert printed.returncode == 0, printed.stderr
    assert "CREATE VIEW pgcoord.holders" in printed.stdout

    other = pg_server.janitor("pgcoord_sql_parity")
    other.init()
    try:
        other_dsn = pg_server.dsn("pgcoord_sql_parity")
        psql = subprocess.run(
            [str(find_bindir() / "psql"), "-v", "ON_ERROR_STOP=1", "-q", other_dsn],
            input=printed.stdout, capture_output=True, text=True,
        )
        assert psql.returncode == 0, psql.stderr
        assert schema_dump(other_dsn) == schema_dump(fresh_db)
        assert migrations.current(other_dsn) == migrations.current(fresh_db) == migrations.head()
    finally:
        other.drop()


def test_printed_downgrade_sql_removes_everything(fresh_db: str) -> None:
    migrations.upgrade(fresh_db)
    buffer = io.StringIO()
    migrations.downgrade(fresh_db, "base", sql=True, output=buffer)
    psql = subprocess.run(
        [str(find_bindir() / "psql"), "-v", "ON_ERROR_STOP=1", "-q", fresh_db],
        input=buffer.getvalue(), capture_output=True, text=True,
    )
    assert psql.returncode == 0, psql.stderr
    assert pgcoord_objects(fresh_db) == []


def test_three_replicas_migrating_at_once_apply_it_once(fresh_db: str) -> None:
    # Each replica waits on a barrier file so the three start within milliseconds.
    script = textwrap.dedent(
        """
        import sys, time, pathlib
        import pgcoord.migrations as m
        go = pathlib.Path(sys.argv[2])
        while not go.exists():
            time.sleep(0.001)
        before = m.current(sys.argv[1])
        m.upgrade(sys.argv[1])
        print(before, m.current(sys.argv[1]))
        """
    )
    barrier = Path(f"/tmp/pgcoord-migrate-go-{fresh_db.rsplit('/', 1)[1]}")
    barrier.unlink(missing_ok=True)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, fresh_db, str(barrier)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        barrier.touch()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        barrier.unlink(missing_ok=True)
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert out.split()[-1] == migrations.head()
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("select version_num from pgcoord.alembic_version").fetchall() == [
            (migrations.head(),)
        ]


def test_every_revision_steps_up_and_down(fresh_db: str) -> None:
    steps = migrations.revisions()
    assert steps[0] == "0001" and steps[-1] == migrations.head()
    for revision in steps:
        migrations.upgrade(fresh_db, revision)
        assert migrations.current(fresh_db) == revision
    for previous in reversed(["base", *steps[:-1]]):
        migrations.downgrade(fresh_db, previous)
        assert migrations.current(fresh_db) == (None if previous == "base" else previous)
    assert pgcoord_objects(fresh_db) == []


def test_sql_lock_key_agrees_with_python_on_every_vector(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        for vector in VECTORS:
            (sql_key,) = conn.execute("select pgcoord.lock_key(%s)", (vector["name"],)).fetchone()  # type: ignore[misc]
            assert sql_key == vector["key"] == pgcoord.lock_key(vector["name"])


def test_holders_view_decodes_negative_and_positive_keys(dsn: str) -> None:
    keys = [-1, 2**63 - 1, -(2**63), 0, 4294967296, pgcoord.lock_key("my-lock")]
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn) as viewer:
        for k in keys:
            holder.execute("select pg_advisory_xact_lock(%s)", (k,))
        rows = viewer.execute(
            "select key from pgcoord.holders where pid = %s", (holder.info.backend_pid,)
        ).fetchall()
        holder.rollback()
    assert sorted(r[0] for r in rows) == sorted(keys)


def test_an_application_includes_pgcoord_from_its_own_alembic(fresh_db: str, tmp_path: Path) -> None:
    """The recipe from the README: the app's revision calls pgcoord's upgrade."""
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(textwrap.dedent(
        """
        from alembic import context
        from sqlalchemy import create_engine, pool
        engine = create_engine(context.config.get_main_option("sqlalchemy.url"),
                               poolclass=pool.NullPool)
        with engine.connect() as connection:
            context.configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
        """
    ))
    (tmp_path / "versions" / "a1_app.py").write_text(textwrap.dedent(
        """
        from alembic import op
        import pgcoord.migrations

        revision = "a1"
        down_revision = None

        def upgrade():
            op.execute("create table app_things (id int primary key)")
            pgcoord.migrations.upgrade(op.get_bind(), "0001")
            op.execute("create table app_after (id int primary key)")

        def downgrade():
            op.execute("drop table app_after")
            pgcoord.migrations.downgrade(op.get_bind(), "base")
            op.execute("drop table app_things")
        """
    ))
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(tmp_path))
    cfg.set_main_option("sqlalchemy.url", migrations.sqlalchemy_url(fresh_db))
    command.upgrade(cfg, "head")
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("select version_num from public.alembic_version").fetchall() == [("a1",)]
        assert conn.execute("select version_num from pgcoord.alembic_version").fetchall() == [
            ("0001",)
        ]
        assert conn.execute("select to_regclass('app_after')").fetchone() == ("app_after",)
    command.downgrade(cfg, "base")
    assert pgcoord_objects(fresh_db) == []
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("select to_regclass('app_things')").fetchone() == (None,)


def test_alembic_cli_works_from_a_checkout(fresh_db: str) -> None:
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(root / "alembic.ini"), "-x", f"dsn={fresh_db}",
         "upgrade", "head"], capture_output=True, text=True, cwd=root,
    )
    assert result.returncode == 0, result.stderr
    assert migrations.current(fresh_db) == migrations.head()


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_migrate_accepts_either_driver_url(fresh_db: str, driver: str) -> None:
    url = fresh_db.replace("postgresql://", f"postgresql+{driver}://")
    migrations.upgrade(url)
    assert migrations.current(fresh_db) == migrations.head()
