"""What the ``pgcoord`` command tells an operator when something goes wrong.

Every failure becomes one line on stderr that says what happened and what to do,
and an exit code per kind of failure (see ``EXIT_CODES``), so scripts can tell
"wrong DSN" from "schema not installed". The traceback is for ``--debug``.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .._core import errmap as _errmap
from .._core.errmap import _chain, sqlstate
from .._drivers.adapt import is_connect_error
from ..errors import SchemaMissing

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_SCHEMA = 4
EXIT_PRIVILEGE = 5
EXIT_NOT_FOUND = 6
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # what a shell reports for a command that SIGPIPE ended

EXIT_CODES = (
    (EXIT_OK, "done"),
    (EXIT_ERROR, "an unexpected error (run again with --debug for the traceback)"),
    (EXIT_USAGE, "usage: a bad option, no --dsn, or a --dsn that is not a PostgreSQL connection string"),
    (EXIT_CONNECT, "cannot connect: refused, unknown host, no answer, login refused, no such database"),
    (EXIT_SCHEMA, "pgcoord's schema is not installed, or is at a revision this pgcoord does not know"),
    (EXIT_PRIVILEGE, "connected, but the role lacks a privilege the command needs"),
    (EXIT_NOT_FOUND, "no such schedule (pgcoord jobs pause|resume|trigger|history NAME)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C; a --watch ends with 0)"),
    (EXIT_BROKEN_PIPE, "the reader of the output went away (as in `| head`)"),
)

# Seconds to wait for a server that does not answer, unless the DSN or
# PGCONNECT_TIMEOUT says otherwise: libpq's own default is to wait for ever.
CONNECT_TIMEOUT = 10


@dataclass
class CliError(Exception):
    """A failure the command explains in one line and exits with ``code``."""

    code: int
    message: str

    def __str__(self) -> str:
        return self.message


# -- the DSN ----------------------------------------------------------------------------

_DSN_EXAMPLE = "postgresql://user:password@host:5432/dbname"


def check_dsn(dsn: str, *, url_only: bool = False) -> str:
    """``dsn`` if it is a PostgreSQL connection string, else ``CliError(EXIT_USAGE)``.

    Caught here rather than by the driver, whose messages for a malformed string
    range from "missing =" to a bare ``int()`` error, or a refused connection.
    """
    scheme, sep, rest = dsn.partition("://")
    if sep:
        if scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
            raise CliError(EXIT_USAGE, f"--dsn is a {scheme}:// URL; expected {_DSN_EXAMPLE}")
        netloc = rest.split("/", 1)[0].split("?", 1)[0].rpartition("@")[2]
        for hostport in netloc.split(","):  # libpq allows host1:port1,host2:port2
            match = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]*)(?::(.*))?", hostport)
            port = match.group(2) if match else hostport
            if port and not _is_port(port):
                raise CliError(EXIT_USAGE, f"--dsn has port {port!r}, which is not a port number "
                                           f"(1 to 65535); expected {_DSN_EXAMPLE}")
    elif url_only:
        what = "key=value pairs (only status takes those)" if "=" in dsn else "not a URL"
        raise CliError(EXIT_USAGE, f"--dsn is {what}; expected {_DSN_EXAMPLE}")
    if sep and "+" in scheme and scheme.split("+", 1)[1] != "psycopg":
        return dsn  # a SQLAlchemy URL for another driver: libpq cannot parse it
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return dsn
    try:
        params = conninfo_to_dict(libpq_dsn(dsn))
    except Exception as exc:  # psycopg.ProgrammingError: libpq could not parse it
        raise CliError(EXIT_USAGE, f"--dsn is not a PostgreSQL connection string ({one_line(exc)}); "
                                   f"expected {_DSN_EXAMPLE}") from exc
    for port in str(params.get("port", "")).split(","):
        if port and not _is_port(port):
            raise CliError(EXIT_USAGE, f"--dsn has port {port!r}, which is not a port number "
                                       "(1 to 65535)")
    for option in _INTEGER_OPTIONS:
        value = str(params.get(option, "0")).strip()
        if not re.fullmatch(r"-?\d{1,9}", value):
            raise CliError(EXIT_USAGE, f"--dsn has {option}={value!r}, which is not a whole number")
    return dsn


def _is_port(text: str) -> bool:
    return text.isdigit() and 1 <= int(text) <= 65535


#: libpq's connection options that take an integer: a bad one is a usage error,
#: caught before connecting (psycopg's own message names no option it came from).
_INTEGER_OPTIONS = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                    "keepalives_count", "tcp_user_timeout")
# libpq's (and psycopg's) refusal of an option's value, which no connecting again fixes.
_BAD_OPTION = re.compile(r"^(invalid (integer )?value|invalid \w+ value|bad value for|"
                         r"unrecognized configuration parameter|invalid connection option)")


def check_number(value: Any, what: str, *, minimum: float, maximum: float,
                 integer: bool = False) -> None:
    """CliError(EXIT_USAGE) unless an option's number is finite and in [minimum, maximum]."""
    if not (isinstance(value, int | float) and math.isfinite(value) and minimum <= value <= maximum):
        kind = "a whole number" if integer else "a number"
        low, high = (f"{int(minimum)}", f"{int(maximum)}") if integer else (f"{minimum:g}", f"{maximum:g}")
        raise CliError(EXIT_USAGE, f"{what} takes {kind} from {low} to {high}, got {value!r}")


def libpq_dsn(dsn: str) -> str:
    """``dsn`` without a SQLAlchemy driver suffix (``postgresql+psycopg://``), for libpq.
    SQLAlchemy's multi-host form, one ``host=h:port`` parameter per server, becomes
    libpq's ``@h1:p1,h2:p2``: libpq would keep only the last ``host=`` and read its
    port as part of the host name."""
    scheme, sep, rest = dsn.partition("://")
    if not (sep and "+" in scheme):
        return dsn
    plain = f"{scheme.split('+', 1)[0]}://{rest}"
    parts = urlsplit(plain)
    userinfo, at, netloc_hosts = parts.netloc.rpartition("@")
    params = parse_qsl(parts.query, keep_blank_values=True)
    hosts = [v for k, v in params if k == "host"]
    if netloc_hosts or not hosts or any(h.startswith("/") for h in hosts) or (
            len(hosts) == 1 and ":" not in hosts[0]):
        return plain  # one host (or a socket directory): libpq reads host= as it is
    others = urlencode([(k, v) for k, v in params if k != "host"], safe=",:/")
    return urlunsplit((parts.scheme, userinfo + at + ",".join(hosts), parts.path, others, parts.fragment))


def has_connect_timeout(dsn: str) -> bool:
    """Whether the DSN or the environment already says how long to wait for a server."""
    if os.environ.get("PGCONNECT_TIMEOUT"):
        return True
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return "connect_timeout" in dsn
    try:
        return "connect_timeout" in conninfo_to_dict(libpq_dsn(dsn))
    except Exception:
        return False


def with_connect_timeout(url: str) -> str:
    """A libpq URL with ``connect_timeout`` added unless one is set (not for asyncpg URLs,
    whose parser would send it to the server as a setting)."""
    scheme, sep, _ = url.partition("://")
    if not sep or "asyncpg" in scheme or has_connect_timeout(url):
        return url
    return f"{url}{'&' if '?' in url else '?'}connect_timeout={CONNECT_TIMEOUT}"


def describe(dsn: str) -> str:
    """Where ``dsn`` points, as ``user@host:port/dbname``, never with its password."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        params = {k: str(v) for k, v in conninfo_to_dict(libpq_dsn(dsn)).items()}
    except Exception:
        return "the database"
    where = params.get("host", "") or "the local socket"
    if params.get("port"):
        where += f":{params['port']}"
    if params.get("dbname"):
        where += f"/{params['dbname']}"
    if params.get("user"):
        where = f"{params['user']}@{where}"
    return where


# -- explaining an exception ------------------------------------------------------------

def one_line(exc: BaseException) -> str:
    """The first line of a driver's message, without libpq's prefixes that repeat
    what the rest of our line says already."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\([\w.]+\)\s*", "", text)  # SQLAlchemy's "(psycopg.OperationalError) "
    text = re.sub(r"^(connection failed|connection is bad):\s*", "", text)
    text = re.sub(r'^connection to server (at|on) .*? failed:\s*', "", text)
    text = re.sub(r"^(FATAL|ERROR):\s*", "", text)
    return text.rstrip(".")


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's own exception under SQLAlchemy's wrapper, else ``exc``."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


# SQLSTATEs that mean the session could not be had, with what to do about each.
_CONNECT_HINTS = {
    _errmap.SQLSTATE_INVALID_PASSWORD: "check the password (in --dsn, PGPASSWORD or ~/.pgpass)",
    _errmap.SQLSTATE_INVALID_AUTHORIZATION: "check the user name in --dsn, and that pg_hba.conf lets it in",
    _errmap.SQLSTATE_INVALID_CATALOG_NAME: "check the database name in --dsn (or create the database)",
    _errmap.SQLSTATE_TOO_MANY_CONNECTIONS:
        "the server has no free connection slot: try again, or raise max_connections",
    _errmap.SQLSTATE_CANNOT_CONNECT_NOW: "the server is starting or stopping: try again in a moment",
}
_GENERIC_CONNECT_HINT = (
    "check that PostgreSQL runs there and that --dsn has the right host, port, user, "
    "password and database"
)


def _is_connect_failure(exc: BaseException, code: str | None) -> bool:
    if code is not None:
        return code[:2] in ("08", "28") or code in (
            _errmap.SQLSTATE_INVALID_CATALOG_NAME, _errmap.SQLSTATE_TOO_MANY_CONNECTIONS,
            *_errmap.SESSION_ENDED)
    for e in _chain(exc):
        if isinstance(e, OSError):  # refused, unknown host, reset, timed out
            return True
        if is_connect_error(e):  # psycopg's OperationalError: refused, timed out, login refused
            return True
    return False


# An optional dependency a command imports, and the extra that brings it.
_EXTRAS = {"alembic": "migrate", "sqlalchemy": "migrate", "psycopg": "psycopg",
           "psycopg_pool": "psycopg", "asyncpg": "asyncpg"}


def explain(exc: BaseException, dsn: str | None) -> CliError:
    """The exit code and the one line for an exception a command raised."""
    if isinstance(exc, CliError):
        return exc
    where = describe(dsn) if dsn else "the database"
    if any(isinstance(e, SchemaMissing) for e in _chain(exc)):
        return CliError(EXIT_SCHEMA, f"pgcoord's schema is not installed in {where}: "
                                     f"install it with `pgcoord migrate --dsn ...`")
    code = sqlstate(exc)
    driver = _driver_error(exc)
    if _BAD_OPTION.match(one_line(driver)) and code is None:
        where_from = "--dsn" + (" or PGCONNECT_TIMEOUT" if os.environ.get("PGCONNECT_TIMEOUT") else "")
        return CliError(EXIT_USAGE, f"a connection option of {where_from} is not valid: "
                                    f"{one_line(driver)}")
    if _is_connect_failure(exc, code):
        hint = _CONNECT_HINTS.get(code or "", _GENERIC_CONNECT_HINT)
        return CliError(EXIT_CONNECT, f"cannot connect to {where}: {one_line(driver)}; {hint}")
    if code == _errmap.SQLSTATE_INSUFFICIENT_PRIVILEGE:
        return CliError(EXIT_PRIVILEGE, f"permission denied in {where}: {one_line(driver)}; run it as "
                                        f"a role that has the privilege (migrate: the database's owner; "
                                        f"status: a role granted sql/roles.sql's operator grants)")
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in _EXTRAS:
        module = (exc.name or "").split(".")[0]
        return CliError(EXIT_ERROR, f"this command needs {module}, which is not installed: "
                                    f"pip install 'pgcoord[{_EXTRAS[module]}]'")
    if type(exc).__name__ == "ServerNotFound":  # pgcoord demo without PostgreSQL installed
        return CliError(EXIT_ERROR, str(exc))
    return CliError(EXIT_ERROR, f"{type(driver).__name__}: {one_line(driver)} "
                                f"(run again with --debug for the traceback)")
