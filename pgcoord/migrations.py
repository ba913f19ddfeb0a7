"""Installing and upgrading pgcoord's schema with Alembic.

pgcoord's revisions live in their own history (version table
``pgcoord.alembic_version``). Three ways in:

* ``pgcoord migrate --dsn ...`` (or ``upgrade(dsn)``);
* ``alembic -x dsn=... upgrade head`` from a checkout;
* from an application's own Alembic revision, sharing its connection::

      from alembic import op
      import pgcoord.migrations

      def upgrade():
          pgcoord.migrations.upgrade(op.get_bind(), "0001")

      def downgrade():
          pgcoord.migrations.downgrade(op.get_bind(), "base")

Requires the ``migrate`` extra (alembic, SQLAlchemy).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit, urlunsplit

from ._core.resources import migrations_dir, read_sql
from .errors import UnsupportedConnection
from .keys import lock_key

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Connection

__all__ = [
    "HEAD",
    "MIGRATE_LOCK_KEY",
    "SCHEMA",
    "VERSION_TABLE",
    "current",
    "downgrade",
    "run_sql_file",
    "split_statements",
    "sqlalchemy_url",
    "upgrade",
]

SCHEMA = "pgcoord"
VERSION_TABLE = "alembic_version"
HEAD = "head"
MIGRATE_LOCK_KEY = lock_key("pgcoord.migrate")


def sqlalchemy_url(dsn: str) -> str:
    """A libpq URL as a SQLAlchemy URL, for the driver the one DSN rule picks for an
    operator's command (psycopg, then asyncpg: Alembic's engine is sync; see
    ``_drivers/dsn.py``). A URL that names its driver (``postgresql+psycopg://``)
    keeps it."""
    scheme, sep, rest = dsn.partition("://")
    if not sep:
        raise ValueError(f"expected a postgresql:// URL, got {dsn!r}")
    if "+" in scheme:
        return _hosts_as_query(dsn)
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a PostgreSQL URL: {dsn!r}")
    from ._drivers.dsn import OPERATOR, choose_driver

    try:
        driver = choose_driver(dsn, prefer=OPERATOR)
    except UnsupportedConnection:
        driver = "psycopg"  # neither installed: SQLAlchemy then says which to install
    return _hosts_as_query(f"postgresql+{driver}://{rest}")


def _hosts_as_query(url: str) -> str:
    """A multi-host URL (``@a:5432,b:5433/db``, as libpq and asyncpg write it) in
    SQLAlchemy's form, one ``host=`` parameter per server: SQLAlchemy's own URL
    parser reads ``5432,b:5433`` as the port and fails."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return url
    query = "&".join(q for q in (parts.query, *(f"host={h}" for h in hosts.split(","))) if q)
    return urlunsplit((parts.scheme, userinfo + at, parts.path or "/", query, parts.fragment))


def split_statements(script: str) -> list[str]:
    """Split a SQL script into statements on top-level semicolons.

    Understands ``--`` comments, quoted strings and identifiers, and dollar
    quoting, which is all the SQL in ``sql/`` uses. Needed because drivers
    using the extended protocol (asyncpg) accept one statement per call.
    """
    statements: list[str] = []
    current: list[str] = []
    i, n = 0, len(script)
    while i < n:
        ch = script[i]
        if script.startswith("--", i):
            end = script.find("\n", i)
            i = n if end < 0 else end + 1
            current.append("\n")
            continue
        if ch in ("'", '"'):
            end = i + 1
            while end < n:
                if script[end] == ch:
                    if end + 1 < n and script[end + 1] == ch:
                        end += 2
                        continue
                    break
                end += 1
            current.append(script[i : end + 1])
            i = end + 1
            continue
        if ch == "$":
            close = script.find("$", i + 1)
            tag = script[i : close + 1] if close > 0 else ""
            if tag and (tag == "$$" or tag[1:-1].replace("_", "a").isalnum()):
                end = script.find(tag, close + 1)
                if end < 0:
                    raise ValueError(f"unterminated dollar quote {tag}")
                current.append(script[i : end + len(tag)])
                i = end + len(tag)
                continue
        if ch == ";":
            if stmt := "".join(current).strip():
                statements.append(stmt)
            current = []
            i += 1
            continue
        current.append(ch)
        i += 1
    if stmt := "".join(current).strip():
        statements.append(stmt)
    return statements


def run_sql_file(filename: str) -> None:
    """Run one of pgcoord's ``sql/`` files from inside an Alembic revision."""
    from alembic import context, op

    for statement in split_statements(read_sql(filename)):
        if context.is_offline_mode():
            op.execute(statement)
        else:
            # exec_driver_sql: no bind-parameter parsing of the SQL text.
            op.get_bind().exec_driver_sql(statement)


def _config(target: str | Connection | None, output: TextIO | None = None) -> Config:
    from alembic.config import Config

    cfg = Config(output_buffer=output or sys.stdout, stdout=output or sys.stdout)
    cfg.set_main_option("script_location", str(migrations_dir()))
    if isinstance(target, str):
        cfg.set_main_option("sqlalchemy.url", sqlalchemy_url(target).replace("%", "%%"))
    elif target is not None:
        cfg.attributes["connection"] = target
    return cfg


@contextlib.contextmanager
def _preserve_outer_alembic() -> Iterator[None]:
    """Keep an enclosing Alembic run's ``op`` and ``context`` working.

    Alembic installs ``alembic.op`` and ``alembic.context`` as module-level
    proxies and removes them when a run ends; a run nested inside an
    application's migration would otherwise leave the application's run
    without them.
    """
    from alembic import context, op

    saved: list[Any] = [getattr(m, "_proxy", None) for m in (context, op)]
    try:
        yield
    finally:
        for proxy in saved:
            if proxy is not None:
                proxy._install_proxy()


def upgrade(
    target: str | Connection, revision: str = HEAD, *, sql: bool = False,
    output: TextIO | None = None,
) -> None:
    """Upgrade pgcoord's schema to ``revision``.

    ``target`` is a DSN, or a SQLAlchemy ``Connection`` whose transaction the
    upgrade joins (it does not commit). With ``sql=True`` the DDL is written to
    ``output`` instead of being run (``target`` is then only used for its dialect).
    """
    from alembic import command

    with _preserve_outer_alembic():
        command.upgrade(_config(target, output), revision, sql=sql)


def downgrade(
    target: str | Connection, revision: str, *, sql: bool = False, output: TextIO | None = None,
) -> None:
    """Downgrade to ``revision``; ``"base"`` removes every pgcoord object."""
    from alembic import command

    if sql and ":" not in revision:
        revision = f"{HEAD}:{revision}"
    with _preserve_outer_alembic():
        command.downgrade(_config(target, output), revision, sql=sql)


def current(target: str | Connection) -> str | None:
    """The installed revision, or None when pgcoord's schema is not installed.

    Reads the version table directly: running the environment for this would
    create the schema as a side effect.
    """
    from sqlalchemy import create_engine, pool, text

    def read(connection: Connection) -> str | None:
        table = f"{SCHEMA}.{VERSION_TABLE}"
        if connection.execute(text(f"SELECT to_regclass('{table}')")).scalar() is None:
            return None
        version = connection.execute(text(f"SELECT version_num FROM {table}")).scalar()
        return None if version is None else str(version)

    if not isinstance(target, str):
        return read(target)
    engine = create_engine(sqlalchemy_url(target), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            return read(connection)
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision this pgcoord ships."""
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory(str(migrations_dir())).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"pgcoord's migrations should have one head, found {heads}")
    return heads[0]


def revisions() -> list[str]:
    """Every revision from the first to the head, in order."""
    from alembic.script import ScriptDirectory

    walk = ScriptDirectory(str(migrations_dir())).walk_revisions("base", "heads")
    return [script.revision for script in reversed(list(walk))]
