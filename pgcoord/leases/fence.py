"""``check_fence``: a fenced write's guard, in the writer's own transaction; see
docs/leases.md.

The check locks the lease's row ``FOR SHARE`` in the caller's transaction, so a
takeover waits until that transaction ends; the SQL function raises SQLSTATE
``PC002`` for a fence that is stale, released or expired. ``pgcoord.leases``
re-exports ``check_fence``. Running the check is the one step that differs
between async and sync connections: its sync half is generated from the async
one (``pgcoord.locks.txscope``).
"""

from __future__ import annotations

from typing import Any

from .._core import errmap as _errmap
from .._drivers import adapt
from ..errors import PgcoordError, StaleFence, UnsupportedConnection
from ..locks.txscope._async.fence import fence_error_async
from ..locks.txscope._sync.fence import fence_error_sync
from ..observability import metrics

__all__ = ["SQLSTATE_STALE_FENCE", "check_fence"]

SQLSTATE_STALE_FENCE = "PC002"

_OUTSIDE_TRANSACTION = (
    "check_fence ran outside a transaction, so the row lock that fences the write ended with "
    "the statement: run it inside the transaction that makes the fenced write "
    "(asyncpg: `async with conn.transaction():`; psycopg: without autocommit, or in "
    "`conn.transaction()`; SQLAlchemy: not on an AUTOCOMMIT connection)"
)


def _stale(exc: BaseException, name: str, fence: int) -> BaseException:
    code = _errmap.sqlstate(exc)
    if code == SQLSTATE_STALE_FENCE:
        metrics.fence_rejected(name, fence)
        message = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        return StaleFence(message)
    return _errmap.as_schema_missing(exc)


def _outcome(conn: Any, error: BaseException | None, name: str, fence: int) -> None:
    """Raise what the check found; misuse first, since it fenced nothing either way."""
    if adapt(conn).in_transaction(conn) is False:
        raise PgcoordError(_OUTSIDE_TRANSACTION) from (
            None if error is None else _stale(error, name, fence))
    if error is not None:
        mapped = _stale(error, name, fence)
        if mapped is error:
            mapped = _errmap.as_schema_missing(error)  # also: a read-only transaction
        if mapped is error:
            raise error
        raise mapped from error


def check_fence(conn: Any, name: str, fence: int) -> Any:
    """Raise ``StaleFence`` unless ``fence`` is current for lease ``name``.

    Locks the lease row ``FOR SHARE`` in ``conn``'s transaction, so a takeover
    waits until that transaction ends: run it first in the transaction that
    does the fenced write. Returns an awaitable for async connections (asyncpg,
    psycopg ``AsyncConnection``, SQLAlchemy ``AsyncConnection``) and runs at
    once for sync ones (psycopg ``Connection``, SQLAlchemy ``Connection``).

    Outside a transaction the row lock would end with the check's own statement
    and fence nothing, so that raises ``PgcoordError`` (asyncpg outside
    ``conn.transaction()``, psycopg in autocommit outside ``conn.transaction()``,
    SQLAlchemy on an AUTOCOMMIT connection). A psycopg or SQLAlchemy connection
    without autocommit opens its transaction with the check itself, which is fine:
    the writes that follow join it until commit.

    The SQL function ``pgcoord.check_fence(name, fence)`` cannot tell: in
    autocommit, one statement that both checks and writes (a trigger on the
    written table) is fenced, while a check in a statement of its own followed by
    a write in another is not. Call it in the same transaction as the write.
    """
    if not isinstance(name, str):
        raise TypeError(f"lease name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lease name must not be empty")
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError("fence must be an int")
    adapter = adapt(conn)
    if adapter.is_pool:
        raise UnsupportedConnection(
            f"check_fence takes the connection whose transaction makes the fenced write, "
            f"not a pool or engine ({adapter.description})")
    if adapter.is_async:
        async def check() -> None:
            _outcome(conn, await fence_error_async(conn, name, fence), name, fence)
        return check()
    _outcome(conn, fence_error_sync(conn, name, fence), name, fence)
    return None
