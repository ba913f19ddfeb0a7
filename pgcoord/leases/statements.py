"""What a lease is given, checked (names, ttls, holders), and the statements a
``Lease`` runs: each in a transaction of its own on a connection borrowed from the
pool for it alone, tried again on another when the pool lends a dead one."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._core import errmap as _errmap
from .._core.checks import SECONDS_MAX, duration, text
from .._drivers import autocommit_retrying, release_async, tx_session_async
from .._drivers.adapt import is_pool_timeout
from .._drivers.capacity import pool_capacity
from .._drivers.protocol import TxSession
from ..errors import PgcoordError
from .fence import SQLSTATE_STALE_FENCE as SQLSTATE_STALE_FENCE
from .fence import check_fence as check_fence

if TYPE_CHECKING:
    pass


log = logging.getLogger("pgcoord.leases")

T = TypeVar("T")

# Tries of one statement when the pool hands out connections that turn out dead:
# after a server restart every idle connection of a pool is, and a pool only
# finds out on use. One more than the pool has connections, within these bounds.
MIN_ATTEMPTS, MAX_ATTEMPTS = 3, 12

def default_holder() -> str:
    """``host:pid:random``: unique per process and instance, readable by operators."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def validate_ttl(ttl: Any) -> float:
    # The lease's expiry is the database clock plus ttl.
    return duration(ttl, "ttl", minimum=0.1, maximum=SECONDS_MAX)


def validate_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lease name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lease name must not be empty")
    return text(name, "lease name")


def validate_holder(holder: Any) -> str:
    """The holder name as given, or a default one; a non-empty str either way."""
    if holder is None:
        return default_holder()
    return text(holder, "holder")


def lock_timeout_setting(seconds: float) -> str:
    """A ``lock_timeout`` value for ``seconds``; never 0, which would mean "no limit"."""
    return f"{max(1, int(seconds * 1000))}ms"


# -- pools ----------------------------------------------------------------------------------

_pool_capacity = pool_capacity


def _refuse_single_connection_pool(source: Any) -> None:
    capacity = _pool_capacity(source)
    if capacity is not None and capacity < 2:
        raise PgcoordError(
            "Lease renews in the background with a connection of its own from the pool, "
            "while the body may hold another: a pool of one connection (max_size=1, or "
            "pool_size=1 with max_overflow=0) cannot serve both, and the lease would be lost "
            "whenever the body held it. Use a pool of at least 2 connections"
        )


def _pool_timeout(exc: BaseException) -> bool:
    """The pool had no connection to give in time: trying again would wait as long again."""
    return is_pool_timeout(exc)


def _dead_connection(exc: BaseException) -> bool:
    """The statement failed because its connection (or the server) was gone."""
    return _errmap.session_gone(exc) and not _pool_timeout(exc)


def _attempts(source: Any) -> int:
    capacity = _pool_capacity(source)
    return MIN_ATTEMPTS if capacity is None else min(max(MIN_ATTEMPTS, capacity + 1), MAX_ATTEMPTS)


class _Statement:
    """Statements in a transaction of their own, each on a connection borrowed from
    the source for it alone, that can be given up without waiting on the server.

    ``abandon()`` (sync, never blocks) cuts the connection of the statement in
    flight, for a renewal given up at the end of the trust window or a release past
    its bound: the server ends that session, the pool drops the connection, and the
    cancelled statement ends at once, without a cancel request over a network that
    may not answer (psycopg before 3.2 would send one on the event loop's thread).
    """

    def __init__(self, source: Any) -> None:
        self._source = source
        self._session: TxSession | None = None
        #: Whether the pool ever lent a connection (False: all were in use meanwhile).
        self.lent = False
        self._abandoned = False

    async def row(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._abandoned:  # given up on: no new try (and no new connection) for it
            raise asyncio.CancelledError
        session = tx_session_async(self._source)
        await session.checkout()
        self._session, self.lent = session, True
        try:
            with _errmap.schema_missing_raised():
                return await autocommit_retrying(session, sql, params)
        except Exception as exc:
            if _dead_connection(exc):
                # Cut it before giving it back, so the pool replaces it: asyncpg
                # before 0.30 would keep a connection the server closed (or one whose
                # protocol state the loss confused) out of its queue for good, and
                # the pool would shrink by one at every such loss.
                session.sever()
            raise
        finally:
            self._session = None
            await release_async(session, rollback=False)

    def abandon(self) -> None:
        self._abandoned = True
        session = self._session
        if session is not None:
            session.sever()


async def _retried(what: str, attempts: int, attempt: Callable[[bool], Awaitable[T]]) -> T:
    """``attempt(retrying)``, tried again while it fails on a dead connection.

    Only for statements that may safely run twice, or whose caller checks what the
    failed try did (``retrying`` tells it)."""
    for n in range(attempts):
        try:
            return await attempt(n > 0)
        except Exception as exc:
            if isinstance(exc, PgcoordError) or n + 1 == attempts or not _dead_connection(exc):
                raise
            log.info("%s failed on a dead connection, trying another: %r", what, exc)
    raise AssertionError("unreachable")
