"""Connecting from a multi-host DSN with a timeout for each host.

A host that accepts TCP connections but never answers (a frozen primary, a proxy
whose backend hangs) must not keep a DSN from its next host. asyncpg applies one
timeout to its whole walk over the hosts and gives up when it runs out, without
trying the rest; libpq (psycopg) waits on each host for ``connect_timeout``, which
is unlimited unless set. So pgcoord gives asyncpg one host at a time, and sets
``connect_timeout`` for psycopg when the DSN does not.
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


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


async def asyncpg_connect(dsn: str, keepalive: float) -> Any:
    """asyncpg.connect(dsn), each listed host tried in turn with its own timeout.
    A single-host DSN is connected as it always was."""
    import asyncpg

    hosts = url_hosts(dsn)
    if len(hosts) < 2:
        return await asyncpg.connect(dsn)
    timeout = per_host_timeout(keepalive)
    last: Exception | None = None
    for host, port in hosts:
        try:
            # target_session_attrs in the DSN still applies: a host that does not
            # match raises, and the next one is tried, as libpq does.
            return await asyncpg.connect(dsn, host=host, port=port, timeout=timeout)
        except Exception as exc:  # any failure moves on to the next host
            last = exc
    assert last is not None
    raise last


def psycopg_connect_timeout(dsn: str, keepalive: float) -> dict[str, Any]:
    """``connect_timeout`` for psycopg unless the DSN or PGCONNECT_TIMEOUT sets one
    (libpq and psycopg apply it to each host)."""
    from psycopg.conninfo import conninfo_to_dict

    if "connect_timeout" in conninfo_to_dict(dsn) or os.environ.get("PGCONNECT_TIMEOUT"):
        return {}
    return {"connect_timeout": math.ceil(per_host_timeout(keepalive))}
