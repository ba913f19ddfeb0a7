"""Mapping driver errors to pgcoord's, by SQLSTATE and never by message text."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from ..errors import PgcoordError, SchemaMissing

# Every SQLSTATE pgcoord raises or reads is named here, once.
# pgcoord's own (sql/): PC001 advisory_try, PC002 check_fence, PC003 member_join,
# PC005 a semaphore whose every slot is the caller's own (0005).
SQLSTATE_LOCK_BUSY = "PC001"
SQLSTATE_STALE_FENCE = "PC002"
SQLSTATE_NAME_TAKEN = "PC003"
SQLSTATE_OWN_SLOTS = "PC005"
# The server's.
SQLSTATE_LOCK_NOT_AVAILABLE = "55P03"
SQLSTATE_DEADLOCK = "40P01"
SQLSTATE_OUT_OF_SHARED_MEMORY = "53200"
SQLSTATE_QUERY_CANCELED = "57014"  # a statement stopped part way, its effects unknown
SQLSTATE_INSUFFICIENT_PRIVILEGE = "42501"
SQLSTATE_TOO_MANY_CONNECTIONS = "53300"
SQLSTATE_INVALID_PASSWORD = "28P01"
SQLSTATE_INVALID_AUTHORIZATION = "28000"
SQLSTATE_INVALID_CATALOG_NAME = "3D000"  # no such database
SQLSTATE_CANNOT_CONNECT_NOW = "57P03"
SQLSTATE_SERIALIZATION_FAILURE = "40001"  # a serializable transaction rolled back: no effect
SQLSTATE_READ_ONLY_TRANSACTION = "25006"
SQLSTATE_IDLE_SESSION_TIMEOUT = "57P05"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what SQLAlchemy wraps (``.orig``) and what it was caused by."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        orig = getattr(e, "orig", None)
        todo += [e.__cause__, orig if isinstance(orig, BaseException) else None]


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error from asyncpg, psycopg, psycopg2, pg8000 or
    SQLAlchemy, if any."""
    for e in _chain(exc):
        for attr in ("sqlstate", "pgcode"):
            code = getattr(e, attr, None)
            if isinstance(code, str) and len(code) == 5:
                return code
        # pg8000 passes the server's error fields as a dict; "C" is the SQLSTATE.
        fields = e.args[0] if e.args else None
        if isinstance(fields, dict):
            code = fields.get("C")
            if isinstance(code, str) and len(code) == 5:
                return code
    return None


# The server ended the session: admin_shutdown, crash_shutdown, cannot_connect_now,
# and the settings that end a session: idle_session_timeout (57P05),
# idle_in_transaction_session_timeout (25P03), transaction_timeout (25P04, PostgreSQL 17+).
SESSION_ENDED = ("57P01", "57P02", SQLSTATE_CANNOT_CONNECT_NOW, SQLSTATE_IDLE_SESSION_TIMEOUT,
                 "25P03", "25P04")


def session_gone(exc: BaseException) -> bool:
    """Whether ``exc`` means the session itself is gone (not just a statement failed).

    A connection exception (class 08), the server ending the session, or an error
    with no SQLSTATE at all: the socket broke or the driver gave up on it.
    """
    code = sqlstate(exc)
    if code is None:
        return not isinstance(exc, asyncio.CancelledError | PgcoordError)
    return code.startswith("08") or code in SESSION_ENDED


# undefined_table, invalid_schema_name, undefined_function: pgcoord's schema is
# not installed (or not at the revision this code needs).
_SCHEMA_MISSING = ("42P01", "3F000", "42883")


# What a multi-host DSN with target_session_attrs=read-write says when no host takes
# writes: asyncpg raises this class; libpq (psycopg) gives no SQLSTATE, only its text.
_NO_WRITABLE_HOST_CLASS = "TargetServerAttributeNotMatched"
_NO_WRITABLE_HOST_MESSAGES = ("session is read-only", "server is in hot standby mode")


def read_only(exc: BaseException) -> bool:
    """The database takes no writes: a write refused as read-only (25006, also as
    pgcoord's own error for it) or no host of the DSN that takes writes."""
    for e in _chain(exc):
        if sqlstate(e) == SQLSTATE_READ_ONLY_TRANSACTION or type(e).__name__ == _NO_WRITABLE_HOST_CLASS:
            return True
        if isinstance(e, PgcoordError) and str(e) in (READ_ONLY_MESSAGE, STANDBY_MESSAGE):
            return True
        if sqlstate(e) is None and any(m in str(e) for m in _NO_WRITABLE_HOST_MESSAGES):
            return True
    return False


READ_ONLY_MESSAGE = (
    "the server refused a write of pgcoord's because the transaction is read-only "
    "(SQLSTATE 25006): default_transaction_read_only is on for this server, database or "
    "role, or the transaction was opened READ ONLY, or the server is a standby (as a primary "
    "is while its HA manager has demoted it: Patroni, until its DCS is back). pgcoord "
    "writes its own rows (leases, fences, schedules): set default_transaction_read_only = "
    "off for pgcoord's role (ALTER ROLE ... SET default_transaction_read_only = off), "
    "open the transaction READ WRITE, or connect to the primary")


STANDBY_MESSAGE = (
    "the server is a hot standby (in recovery): PostgreSQL grants advisory locks there, "
    "but they exclude only the standby's own sessions, not those of the primary, so "
    "pgcoord takes none. Connect to the primary: a multi-host DSN with "
    "target_session_attrs=read-write, or the HA manager's address for the leader")


def as_schema_missing(exc: BaseException) -> BaseException:
    """``SchemaMissing`` for an error that says the schema is absent, a
    ``PgcoordError`` naming the setting for a write refused as read-only, else ``exc``."""
    code = sqlstate(exc)
    if code in _SCHEMA_MISSING:
        return SchemaMissing()
    if code == SQLSTATE_READ_ONLY_TRANSACTION:
        return PgcoordError(READ_ONLY_MESSAGE)
    return exc


# The server's FATAL message for it (PostgreSQL 14+), which older psycopg versions
# report only as text, in an OperationalError with no SQLSTATE ("consuming input
# failed: terminating connection due to idle-session timeout").
_IDLE_SESSION_MESSAGE = "terminating connection due to idle-session timeout"


def ended_while_idle(exc: BaseException) -> bool:
    """The server had ended the session for its idle_session_timeout before this
    statement was sent (a pool's idle connection): the statement never ran."""
    code = sqlstate(exc)
    return code == SQLSTATE_IDLE_SESSION_TIMEOUT or (code is None and _IDLE_SESSION_MESSAGE in str(exc))


def serialization_failure(exc: BaseException) -> bool:
    """The server rolled back a serializable transaction (the database's or role's
    default_transaction_isolation): a statement of its own had no effect, and may
    run again."""
    return sqlstate(exc) == SQLSTATE_SERIALIZATION_FAILURE


@contextlib.contextmanager
def schema_missing_raised() -> Iterator[None]:
    """Raise ``SchemaMissing`` for an error in the block that says the schema is
    absent; let every other error through unchanged."""
    try:
        yield
    except Exception as exc:
        mapped = as_schema_missing(exc)
        if mapped is exc:
            raise
        raise mapped from exc
