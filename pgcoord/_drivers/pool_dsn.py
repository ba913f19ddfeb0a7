"""The DSN a pool or engine connects with, for sessions of pgcoord's own beside it.

A ``Scheduler(pool)`` ties its claims to a private member, whose sessions must not
be the pool's (a member's session outlives any checkout, and is set up in ways a
pool's next borrower must not inherit). So it opens them as the pool would: from
the pool's own connection parameters. Each driver keeps them in its own shape —
asyncpg's pool the arguments of ``asyncpg.connect``, psycopg's pool a conninfo and
keyword arguments, a SQLAlchemy engine a URL its dialect turns into either — and
they are turned here into one DSN for that driver. What cannot be put in a DSN
(an ``ssl.SSLContext``, a password callable, a ``connect=`` function of one's own)
is refused with ``UnsupportedConnection`` saying so: the caller then passes a
``member=`` of its own.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from ..errors import UnsupportedConnection
from .adapt import driver_of

#: asyncpg.connect arguments that only shape the connection once made: a member
#: does without them.
_ASYNCPG_IGNORED = frozenset({
    "timeout", "command_timeout", "statement_cache_size", "max_cached_statement_lifetime",
    "max_cacheable_statement_size", "server_settings", "connection_class", "record_class", "loop",
    "prepared_statement_cache_size", "prepared_statement_name_func",
})
#: asyncpg.connect arguments with a DSN parameter of the same meaning.
_ASYNCPG_PARAMS = {"host": "host", "port": "port", "user": "user", "password": "password",
                   "database": "dbname", "passfile": "passfile",
                   "target_session_attrs": "target_session_attrs", "krbsrvname": "krbsrvname",
                   "gsslib": "gsslib"}


def pool_dsn(source: Any) -> tuple[str, str]:
    """(DSN, driver) to open sessions of one's own to where ``source`` connects."""
    driver = driver_of(source)
    if driver == "asyncpg":
        connect = getattr(source, "_connect", None)
        if connect is not None and getattr(connect, "__module__", "").partition(".")[0] != "asyncpg":
            raise UnsupportedConnection("the pool connects with a connect= function of its own")
        args = tuple(getattr(source, "_connect_args", ()))
        return _asyncpg_dsn(args[0] if args else None, dict(getattr(source, "_connect_kwargs", {}))), driver
    if driver == "psycopg":
        return _psycopg_dsn(str(source.conninfo), dict(source.kwargs or {})), driver
    if driver == "sqlalchemy":
        sync = source.sync_engine
        name = sync.url.get_driver_name()
        if name not in ("asyncpg", "psycopg"):
            raise UnsupportedConnection(f"the engine's driver is {name!r}")
        _, params = sync.dialect.create_connect_args(sync.url)
        if name == "asyncpg":
            return _asyncpg_dsn(None, dict(params)), name
        return _psycopg_dsn("", dict(params)), name
    raise UnsupportedConnection(f"pgcoord cannot tell where {type(source).__qualname__} connects")


def _asyncpg_dsn(dsn: Any, kwargs: dict[str, Any]) -> str:
    params: dict[str, str] = {}
    for key, value in kwargs.items():
        if value is None or key in _ASYNCPG_IGNORED:
            continue
        if key == "ssl":
            if value is True:
                params["sslmode"] = "require"
            elif isinstance(value, str):
                params["sslmode"] = value
            elif value is not False:
                raise UnsupportedConnection("the pool connects with an ssl= object, which no DSN holds")
            continue
        name = _ASYNCPG_PARAMS.get(key)
        if name is None or callable(value):
            raise UnsupportedConnection(f"the pool connects with {key}=, which no DSN holds")
        params[name] = (",".join(str(v) for v in value) if isinstance(value, list | tuple)
                        else str(value))
    base = "postgresql://" if dsn is None else str(dsn)
    if not params:
        return base
    # asyncpg lets keyword arguments win over the DSN, but a URL's own parts (its
    # user, password, hosts and database) win over its query: so those are written
    # into the URL itself, and only the rest goes in the query.
    base = _with_url_parts(base, params)
    if not params:
        return base
    return base + ("&" if "?" in base else "?") + urlencode(params)


def _with_url_parts(url: str, params: dict[str, str]) -> str:
    """``url`` with the user, password, hosts/ports and database of ``params`` (taken
    out of it) in place of its own. A host that is a socket directory stays in
    ``params``, and the URL then names no host (asyncpg reads it from the query)."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if "user" in params:
        user = quote(params.pop("user"), safe="")
    if "password" in params:
        password, colon = quote(params.pop("password"), safe=""), ":"
    if "host" in params or "port" in params:
        old = [_host_port(h) for h in hostlist.split(",")] if hostlist else []
        hosts = params["host"].split(",") if "host" in params else [h for h, _p in old] or [""]
        ports = params.pop("port").split(",") if "port" in params else [p for _h, p in old if p]
        if any(h.startswith("/") for h in hosts):
            hostlist = ""  # sockets: in the query, with the ports
            if ports:
                params["port"] = ",".join(ports)
        else:
            params.pop("host", None)
            ports = ports if len(ports) == len(hosts) else (ports[:1] * len(hosts))
            hostlist = ",".join(f"{h}:{p}" if p else h for h, p in zip(hosts, ports or [""] * len(hosts),
                                                                       strict=True))
    path = "/" + quote(params.pop("dbname"), safe="") if "dbname" in params else parts.path
    credentials = user + (colon + password if password or colon else "")
    netloc = (credentials + "@" if credentials or at else "") + hostlist
    return urlunsplit((parts.scheme or "postgresql", netloc, path, parts.query, parts.fragment))


def _host_port(item: str) -> tuple[str, str]:
    """``host:port`` of a URL's host list: ``[::1]:5432``, ``db:5432``, ``db``."""
    if item.startswith("["):
        close = item.find("]")
        return item[:close + 1], item[close + 2:]
    host, colon, port = item.rpartition(":")
    return (host, port) if colon else (item, "")


def _psycopg_dsn(conninfo: str, kwargs: dict[str, Any]) -> str:
    from psycopg import pq
    from psycopg.conninfo import make_conninfo

    known = {d.keyword.decode() for d in pq.Conninfo.get_defaults()}
    params = {k: v for k, v in kwargs.items() if k in known and v is not None}
    if any(callable(v) for v in params.values()):
        raise UnsupportedConnection("the pool connects with a parameter no DSN holds")
    return make_conninfo(conninfo, **params)
