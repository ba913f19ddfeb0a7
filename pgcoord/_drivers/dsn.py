"""Opening a DSN: which driver, and how. Every path that opens a connection from a
string goes through here: ``LockHolder(dsn)``, ``Elector(dsn)``, ``Member(dsn)``,
``pgcoord.testing``, the sync twins' pools, ``pgcoord status``, ``pgcoord jobs``,
``pgcoord doctor`` and the SQLAlchemy URL of ``pgcoord migrate``.

The rule (``choose_driver``)
----------------------------
1. ``driver=`` given ("asyncpg" or "psycopg"): that driver. Any other name is a
   ``ValueError``, and so is asyncpg with a key=value DSN, which it cannot read.
2. Otherwise, the first driver of ``prefer`` that is installed and reads the
   DSN's form. Both read a ``postgresql://`` URL (multi-host ones included);
   only psycopg (libpq) reads key=value strings such as
   ``host=a,b port=5432,5432 target_session_attrs=read-write``.
3. None: ``UnsupportedConnection``, naming what to install.

``prefer`` is the one thing callers choose, and there are two orders:

- ``LIBRARY`` (asyncpg, then psycopg), for the library's own long-lived async
  sessions and pools, where asyncpg is the faster driver.
- ``OPERATOR`` (psycopg, then asyncpg), for the operators' commands (status, jobs,
  doctor, migrate): they run a few statements and exit, mostly from sync code
  (psycopg has a sync API; asyncpg needs an event loop), libpq reads every
  parameter an operator may paste (``connect_timeout``, ``service=``; asyncpg would
  send an unknown one to the server as a setting), and the CLI explains libpq's
  connect errors. Alembic's engine is sync, so migrate needs psycopg anyway.

Connecting
----------
A host that accepts TCP connections but never answers (a frozen primary, a proxy
whose backend hangs) must not keep a multi-host DSN from its next host. asyncpg
applies one timeout to its whole walk over the hosts and gives up when it runs
out, without trying the rest; libpq waits on each host for ``connect_timeout``,
which is unlimited unless set. So pgcoord gives asyncpg one host at a time, each
with its own timeout, and sets ``connect_timeout`` for psycopg when neither the
DSN nor ``PGCONNECT_TIMEOUT`` does: on every path, sessions, pools and commands.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ..errors import UnsupportedConnection

__all__ = [
    "DRIVERS", "LIBRARY", "OPERATOR", "asyncpg_connect", "choose_driver", "fetch_rows", "is_url",
    "open_dedicated", "open_pool", "per_host_timeout", "psycopg_connect_timeout", "url_hosts",
]

DRIVERS = ("asyncpg", "psycopg")
#: The library's order: asyncpg first.
LIBRARY = ("asyncpg", "psycopg")
#: The operators' commands' order: psycopg (libpq) first.
OPERATOR = ("psycopg", "asyncpg")

#: Seconds one host of a pool's DSN may take to connect (a pool has no keepalive
#: to go by): ``per_host_timeout`` of a 10 s keepalive.
POOL_HOST_TIMEOUT = 5.0


def is_url(dsn: str) -> bool:
    """A ``postgresql://`` URL (which both drivers read), not a key=value string."""
    return "://" in dsn


def _installed(driver: str) -> bool:
    return importlib.util.find_spec(driver) is not None


def choose_driver(dsn: str, driver: str | None = None, *, prefer: Sequence[str] = LIBRARY) -> str:
    """The driver that opens ``dsn``: see the module's docstring for the rule."""
    url = is_url(dsn)
    if driver is not None:
        if driver not in DRIVERS:
            raise ValueError(f"driver must be 'asyncpg' or 'psycopg', not {driver!r}")
        if driver == "asyncpg" and not url:
            raise ValueError("asyncpg reads only postgresql:// URLs, not key=value DSNs: pass the "
                             "URL form (postgresql://user@host1:5432,host2:5432/db?...) or driver='psycopg'")
        return driver
    readers = [d for d in prefer if url or d == "psycopg"]
    for candidate in readers:
        if _installed(candidate):
            return candidate
    if url:
        raise UnsupportedConnection(f"opening a DSN needs {' or '.join(readers)} installed")
    raise UnsupportedConnection(
        "a key=value DSN needs psycopg installed (asyncpg reads only postgresql:// URLs)")


# -- hosts and timeouts ---------------------------------------------------------------------

def per_host_timeout(keepalive: float) -> float:
    """Seconds one host may take to connect: about the keepalive (the time pgcoord
    allows a silent connection anyway), at least 2 s (libpq's own floor), at most 5 s."""
    return max(2.0, min(keepalive, 5.0))


def url_hosts(dsn: str) -> list[tuple[str, int | None]]:
    """The (host, port) pairs a postgresql:// URL lists, in order: the netloc's
    ``h1:p1,h2:p2`` or, without one, the ``host=``/``port=`` parameters."""
    parts = urlsplit(dsn)
    spec = parts.netloc.rpartition("@")[2]
    params = parse_qs(parts.query)
    ports = [p for p in params.get("port", [""])[-1].split(",") if p]
    if not spec:
        spec = params.get("host", [""])[-1]
    hosts: list[tuple[str, int | None]] = []
    for i, item in enumerate(h for h in spec.split(",") if h):
        if item.startswith("["):  # [v6]:port
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:
            host, port = item, ""
        if not port and i < len(ports):
            port = ports[i]
        hosts.append((unquote(host), int(port) if port else None))
    return hosts


async def asyncpg_connect(dsn: str, host_timeout: float, single_host_timeout: float | None = None,
                          **kwargs: Any) -> Any:
    """``asyncpg.connect(dsn, **kwargs)``, each listed host tried in turn with
    ``host_timeout`` of its own. A single-host DSN is connected as asyncpg would,
    within ``single_host_timeout`` (None: asyncpg's default)."""
    import asyncpg

    hosts = url_hosts(dsn)
    if len(hosts) < 2:
        if single_host_timeout is not None:
            kwargs["timeout"] = single_host_timeout
        return await asyncpg.connect(dsn, **kwargs)
    last: Exception | None = None
    for host, port in hosts:
        try:
            # target_session_attrs in the DSN still applies: a host that does not
            # match raises, and the next one is tried, as libpq does.
            return await asyncpg.connect(dsn, host=host, port=port, timeout=host_timeout, **kwargs)
        except Exception as exc:  # any failure moves on to the next host
            last = exc
    assert last is not None
    raise last


def psycopg_connect_timeout(dsn: str, seconds: float) -> dict[str, Any]:
    """``connect_timeout`` for psycopg unless the DSN or PGCONNECT_TIMEOUT sets one
    (libpq and psycopg apply it to each host)."""
    from psycopg.conninfo import conninfo_to_dict

    if os.environ.get("PGCONNECT_TIMEOUT") or "connect_timeout" in conninfo_to_dict(dsn):
        return {}
    return {"connect_timeout": math.ceil(seconds)}


# -- opening ----------------------------------------------------------------------------------

async def open_dedicated(dsn: str, driver: str, *, keepalive: float,
                         connect_timeout: float | None = None) -> Any:
    """A new async connection of ``driver`` (from ``choose_driver``) in autocommit,
    for a ``DedicatedSession``: TCP keepalives and ``tcp_user_timeout`` from
    ``keepalive`` (psycopg; asyncpg's session probes itself), and each host given
    ``connect_timeout`` seconds (default ``per_host_timeout(keepalive)``)."""
    host_timeout = per_host_timeout(keepalive) if connect_timeout is None else connect_timeout
    if driver == "asyncpg":
        return await asyncpg_connect(dsn, host_timeout, connect_timeout)
    import psycopg

    idle = max(1, int(keepalive / 2))
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, keepalives=1, keepalives_idle=idle,
        keepalives_interval=max(1, idle // 2), keepalives_count=3,
        tcp_user_timeout=int(keepalive * 1000), **psycopg_connect_timeout(dsn, host_timeout),
    )


def _create_pool_takes_connect() -> bool:
    import asyncpg

    return "connect" in inspect.signature(asyncpg.create_pool).parameters  # asyncpg >= 0.30


async def open_pool(dsn: str, *, min_size: int, max_size: int,
                    host_timeout: float = POOL_HOST_TIMEOUT) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """An async pool on ``dsn`` (the library's order: an asyncpg ``Pool``, else a
    psycopg ``AsyncConnectionPool``), open; and how to close it."""
    if choose_driver(dsn) == "asyncpg":
        import asyncpg

        options: dict[str, Any] = {}
        if len(url_hosts(dsn)) > 1 and _create_pool_takes_connect():
            # Before asyncpg 0.30 a pool connects itself, with its one timeout for all hosts.
            options["connect"] = functools.partial(asyncpg_connect, host_timeout=host_timeout)
        apool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, **options)
        return apool, apool.close
    from psycopg_pool import AsyncConnectionPool

    ppool = AsyncConnectionPool(dsn, min_size=min_size, max_size=max_size, open=False,
                                kwargs=psycopg_connect_timeout(dsn, host_timeout))
    await ppool.open()
    return ppool, ppool.close


def fetch_rows(dsn: str, sql: str, params: tuple[Any, ...] = (), *, application_name: str,
               connect_timeout: float, prefer: Sequence[str] = OPERATOR,
               ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """One ``$n``-parameter statement on a connection of its own, in autocommit, from
    sync code (a CLI command): the column names and the rows. Each host of the DSN
    gets ``connect_timeout`` seconds."""
    if choose_driver(dsn, prefer=prefer) == "psycopg":
        import psycopg

        from .._core.queries import to_pyformat

        with psycopg.connect(dsn, autocommit=True, application_name=application_name,
                             **psycopg_connect_timeout(dsn, connect_timeout)) as conn:
            cur = conn.execute(to_pyformat(sql), params or None)
            names = [c.name for c in cur.description or ()]
            return names, [tuple(row) for row in cur.fetchall()] if cur.description else []
    return asyncio.run(_fetch_rows_asyncpg(dsn, sql, params, application_name, connect_timeout))


async def _fetch_rows_asyncpg(dsn: str, sql: str, params: tuple[Any, ...], application_name: str,
                              connect_timeout: float) -> tuple[list[str], list[tuple[Any, ...]]]:
    conn = await asyncpg_connect(dsn, connect_timeout, connect_timeout,
                                 server_settings={"application_name": application_name})
    try:
        statement = await conn.prepare(sql)
        names = [a.name for a in statement.get_attributes()]
        return names, [tuple(r) for r in await statement.fetch(*params)]
    finally:
        await conn.close()
