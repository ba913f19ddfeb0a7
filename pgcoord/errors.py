"""The exceptions pgcoord raises.

Each class's docstring is its default message. Driver exceptions are mapped to
these at the boundary (see ``pgcoord._core.errmap``), so user code never has to catch
an asyncpg or psycopg class to handle a coordination outcome.
"""

from __future__ import annotations

__all__ = [
    "Deadlock",
    "LeaseLost",
    "LockBusy",
    "LockLost",
    "LockTableFull",
    "LockTimeout",
    "PgcoordError",
    "PoolExhausted",
    "SchemaMissing",
    "StaleFence",
    "UnsupportedConnection",
]


class PgcoordError(Exception):
    """A pgcoord operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (type(self).__doc__ or "").strip())


class LockBusy(PgcoordError):
    """The lock is held by another session and wait=False was given."""


class LockTimeout(PgcoordError):
    """The lock was not granted within the timeout (lock_timeout, SQLSTATE 55P03)."""


class Deadlock(PgcoordError):
    """PostgreSQL detected a deadlock and cancelled this lock request (SQLSTATE 40P01)."""


class LockLost(PgcoordError):
    """The session holding the lock was lost while the body ran; the body was cancelled."""


class LeaseLost(LockLost):
    """The lease could not be renewed in time, or was taken over."""


class StaleFence(PgcoordError):
    """The fencing token is no longer current for this lease."""


class SchemaMissing(PgcoordError):
    """The pgcoord schema is not installed: run `pgcoord migrate --dsn ...` or `alembic upgrade head`."""


class UnsupportedConnection(PgcoordError):
    """pgcoord cannot use this object or connection for the requested feature."""


class PoolExhausted(PgcoordError):
    """No connection could be had at once for this lock: its pool had none to lend,
    or the LockHolder's max_wait_connections limit was reached."""


class LockTableFull(PgcoordError):
    """The server's shared lock table is full: raise max_locks_per_transaction
    (lock table size = max_locks_per_transaction * (max_connections + max_prepared_transactions))
    or hold fewer locks at once (SQLSTATE 53200)."""
