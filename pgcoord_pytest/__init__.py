"""pgcoord's pytest plugin (entry point ``pytest11``): the ``pgcoord_dsn`` fixture.

A module of its own, outside the ``pgcoord`` package, so that loading it with every
pytest run imports nothing else: pgcoord, its drivers and pytest-postgresql are
imported only when a test asks for one of these fixtures. The failure helpers are in
``pgcoord.testing``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

ENV_DSN = "PGCOORD_TEST_DSN"


def _params(dsn: str) -> dict[str, str]:
    """The parts of ``dsn`` (a URL or key=value string) by libpq's own rules, percent-
    encoding undone; ``dsn`` itself is kept, to be passed on as the user gave it."""
    from psycopg.conninfo import conninfo_to_dict

    parts = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    return {"host": parts.get("host", "127.0.0.1"), "port": parts.get("port", "5432"),
            "user": parts.get("user", "postgres"), "password": parts.get("password", ""), "dsn": dsn}


def _url(params: dict[str, str], dbname: str, *, url_only: bool = False) -> str:
    """The DSN of database ``dbname``: the user's own DSN with only its database
    changed (its password, hosts and options as given), else one made from the parts."""
    given = params.get("dsn")
    if given and "://" in given:
        parts = urlsplit(given)
        return urlunsplit((parts.scheme, parts.netloc, "/" + quote(dbname), parts.query, parts.fragment))
    if given and not url_only:  # (migrations take URLs only)
        from psycopg.conninfo import make_conninfo

        return make_conninfo(given, dbname=dbname)
    auth = quote(params["user"], safe="") + (
        f":{quote(params['password'], safe='')}" if params.get("password") else "")
    return f"postgresql://{auth}@{params['host']}:{params['port']}/{dbname}"


def _janitor(params: dict[str, str], dbname: str, template: str | None = None) -> Any:
    try:
        from pytest_postgresql.janitor import DatabaseJanitor
    except ImportError as exc:  # pragma: no cover - depends on the user's environment
        raise RuntimeError("pgcoord_dsn needs pytest-postgresql and psycopg: "
                           "pip install 'pgcoord[testing]'") from exc
    return DatabaseJanitor(user=params["user"], host=params["host"], port=params["port"],
                           password=params.get("password") or None, dbname=dbname,
                           template_dbname=template)


@pytest.fixture(scope="session")
def pgcoord_server() -> Iterator[dict[str, str]]:
    """Connection parameters (host, port, user, password) of the test server:
    ``PGCOORD_TEST_DSN`` (a superuser URL) when set, else a throwaway server started
    from the binaries on the machine (as the postgres user when run as root)."""
    if external := os.environ.get(ENV_DSN):
        yield _params(external)
        return
    from pgcoord._core.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    try:
        yield {"host": "127.0.0.1", "port": str(server.port), "user": "postgres", "password": ""}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _pgcoord_template(pgcoord_server: dict[str, str]) -> Iterator[tuple[dict[str, str], str]]:
    import pgcoord.migrations

    params = dict(pgcoord_server)
    name = f"pgcoord_template_{uuid.uuid4().hex[:8]}"
    janitor = _janitor(params, name)
    janitor.init()
    try:
        pgcoord.migrations.upgrade(_url(params, name, url_only=True))
        yield params, name
    finally:
        janitor.drop()


@pytest.fixture
def pgcoord_dsn(_pgcoord_template: tuple[dict[str, str], str]) -> Iterator[str]:
    """A database of this test's own with pgcoord's schema at head; dropped after."""
    params, template = _pgcoord_template
    name = f"pgcoord_{uuid.uuid4().hex[:10]}"
    janitor = _janitor(params, name, template=template)
    janitor.init()
    try:
        yield _url(params, name)
    finally:
        janitor.drop()
