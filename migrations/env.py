"""pgcoord's Alembic environment.

pgcoord keeps its own history: the version table is ``pgcoord.alembic_version``,
so an application's Alembic history in ``public`` is never touched. Concurrent
runs (several replicas migrating at start) are serialised by an advisory lock;
the later ones find the work done.

Where the connection comes from, in order: ``config.attributes["connection"]``
(an application sharing its own connection, see pgcoord.migrations), ``-x dsn=``,
``sqlalchemy.url`` in the ini file, then the PGCOORD_DSN / DATABASE_URL variables.
"""

from __future__ import annotations

import asyncio
import os

from alembic import context
from sqlalchemy import Connection, create_engine, pool, text

from pgcoord.migrations import MIGRATE_LOCK_KEY, SCHEMA, VERSION_TABLE, sqlalchemy_url

config = context.config


def _configured_url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("dsn")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("PGCOORD_DSN")
        or os.environ.get("DATABASE_URL")
    )
    if not url:
        raise SystemExit(
            "pgcoord migrations need a database: pass -x dsn=postgresql://..., "
            "set sqlalchemy.url, or set PGCOORD_DSN"
        )
    return sqlalchemy_url(url)


def _configure(**kw: object) -> None:
    context.configure(
        version_table=VERSION_TABLE,
        version_table_schema=SCHEMA,
        transactional_ddl=True,
        **kw,  # type: ignore[arg-type]
    )


def _destination_is_base() -> bool:
    return context.get_revision_argument() in ("base", None, ())


def run_offline() -> None:
    _configure(url=_configured_url(), literal_binds=True, dialect_name="postgresql")
    with context.begin_transaction():
        context.execute(f"SELECT pg_catalog.pg_advisory_xact_lock({MIGRATE_LOCK_KEY})")
        context.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        context.run_migrations()
        if _destination_is_base():
            context.execute(f"DROP TABLE IF EXISTS {SCHEMA}.{VERSION_TABLE}")
            context.execute(f"DROP SCHEMA IF EXISTS {SCHEMA}")


def _drop_schema_if_empty(connection: Connection) -> None:
    """After a downgrade to base, remove the version table and the schema.

    The schema is only dropped when nothing else lives in it, so objects a user
    put there by hand are never removed with it.
    """
    remaining = connection.execute(
        text(f"SELECT count(*) FROM {SCHEMA}.{VERSION_TABLE}")
    ).scalar_one()
    if remaining:
        return
    connection.execute(text(f"DROP TABLE {SCHEMA}.{VERSION_TABLE}"))
    others = connection.execute(
        text(
            "SELECT (SELECT count(*) FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid)"
            " + (SELECT count(*) FROM pg_catalog.pg_proc p WHERE p.pronamespace = n.oid)"
            " FROM pg_catalog.pg_namespace n WHERE n.nspname = '" + SCHEMA + "'"
        )
    ).scalar_one_or_none()
    if others == 0:
        connection.execute(text(f"DROP SCHEMA {SCHEMA}"))


def _run(connection: Connection, *, shared: bool) -> None:
    if shared:
        # The application's transaction: lock for its duration, commit nothing.
        connection.execute(text(f"SELECT pg_catalog.pg_advisory_xact_lock({MIGRATE_LOCK_KEY})"))
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        if _destination_is_base():
            _drop_schema_if_empty(connection)
        return
    with connection.begin():
        # Held until commit, so a waiting replica reads the version table only
        # after this run's changes are visible.
        connection.execute(text(f"SELECT pg_catalog.pg_advisory_xact_lock({MIGRATE_LOCK_KEY})"))
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        if _destination_is_base():
            _drop_schema_if_empty(connection)


def run_online() -> None:
    shared = config.attributes.get("connection")
    if shared is not None:
        _run(shared, shared=True)
        return
    url = _configured_url()
    if "+asyncpg" in url:
        asyncio.run(_run_async(url))
        return
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run(connection, shared=False)
    finally:
        engine.dispose()


async def _run_async(url: str) -> None:
    # Imported here: SQLAlchemy's asyncio support needs greenlet, which only
    # asyncpg URLs require.
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, poolclass=pool.NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(lambda sync: _run(sync, shared=False))
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
