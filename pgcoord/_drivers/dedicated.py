"""Dedicated sessions for LockHolder, Elector and Member: opened from a DSN or
borrowed from a pool.

A ``HolderConnection`` (a ``DedicatedSession``, see ``_drivers/protocol.py``) is
one driver connection used outside any transaction (session locks, a lease's
doorbell). It tells its owner as soon as the server closes it (``on_lost``) and
can LISTEN; each driver's module implements it (asyncpg reads its socket all the
time; a psycopg connection's socket is watched while it is idle).

A ``ConnectionSource`` (a ``SessionSource``) opens them: ``DsnSource`` its own
from a DSN, by the one rule of ``_drivers/dsn.py``; a pool's or engine's borrows
them (``Adapter.dedicated_source``) and gives them back only after their owner
proved them clean, and *broken* (so the pool replaces them) when they were
discarded.

``open()`` may wait as any borrower of the pool would (the pool's own timeout
becomes ``PoolExhausted``). ``open_now()`` gives another connection only if one
can be had at once: a DSN source opens one; a pool lends one only when it has
one idle or room to open one, and the answer is None otherwise. pgcoord takes
every connection beyond the first with ``open_now()``, so it never waits on a
pool for a connection it itself holds (with ``max_size=1`` that wait could
never end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core.queries import query
from ..errors import UnsupportedConnection
from .adapt import HOLDER_SOURCES, dedicated, describe, find_adapter
from .dsn import LIBRARY, choose_driver, open_dedicated
from .protocol import LEND_TIMEOUT as LEND_TIMEOUT
from .protocol import DedicatedSession, SessionSource

#: What LockHolder, Elector and Member hold: the ``DedicatedSession`` protocol
#: (``_drivers/protocol.py``), implemented by each driver module.
HolderConnection = DedicatedSession


#: Where they come from (``_drivers/protocol.py``): ``DsnSource`` below, or a pool's
#: or engine's (``Adapter.dedicated_source``, in each driver's module).
ConnectionSource = SessionSource


class DsnSource(SessionSource):
    """Connections of its own, opened from a DSN by the driver ``choose_driver``
    picks (``driver=`` if given; ``prefer`` is the library's order unless a
    caller, such as doctor, is an operator's command)."""

    def __init__(self, dsn: str, driver: str | None, keepalive: float, *,
                 prefer: Sequence[str] = LIBRARY, connect_timeout: float | None = None) -> None:
        self.driver = choose_driver(dsn, driver, prefer=prefer)
        self.dsn, self.keepalive, self.connect_timeout = dsn, keepalive, connect_timeout

    async def open(self) -> HolderConnection:
        conn = await open_dedicated(self.dsn, self.driver, keepalive=self.keepalive,
                                    connect_timeout=self.connect_timeout)
        return dedicated(conn, None)

    async def open_now(self) -> HolderConnection:
        return await self.open()


def connection_source(source: Any, driver: str | None, keepalive: float) -> ConnectionSource:
    """The ``ConnectionSource`` for what a user handed to ``LockHolder``."""
    if isinstance(source, str):
        if "://" not in source and "=" not in source:
            raise ValueError("LockHolder needs a DSN (postgresql://...) or a pool")
        return DsnSource(source, driver, keepalive)
    if driver is not None:
        raise ValueError("driver= is only for a DSN; a pool already has its driver")
    found = find_adapter(source)
    if found is None:
        raise UnsupportedConnection(f"LockHolder cannot use {describe(source)}; expected {HOLDER_SOURCES}")
    return found.dedicated_source(source)


async def behind_transaction_pooler(source: ConnectionSource, conn: HolderConnection) -> bool:
    """Whether ``conn`` reaches the server through a transaction-mode pooler.

    First, on ``conn`` alone: the server announces its process id when the
    connection is made, and ``pg_backend_pid()`` reports the process that runs
    the session. When the two agree nothing between us switches server sessions
    (a pooler announces an id of its own), and no other connection is needed.
    ``conn.backend_pid`` must already be set.

    When they differ a pooler is in between, and only its mode matters: behind
    PgBouncer in transaction mode a client's statements may run on different
    server sessions, and an idle client's server session is handed to the next
    client. So a second client from the same source asks for its server pid,
    then ``conn`` asks again: the pid must stay put, and must not be the one the
    second client got. The second client is taken with ``open_now()``; a pool
    that has none to lend at once gets ``UnsupportedConnection`` (it cannot be
    told from a transaction-mode one), never a wait on the pool.
    """
    if conn.announced_pid() == conn.backend_pid:
        return False
    other = await source.open_now()
    if other is None:
        raise UnsupportedConnection(
            "there is a pooler between this pool and the server (the server process that runs "
            "the session is not the one announced at connect), and telling a session-mode "
            "pooler from a transaction-mode one needs a second connection for a moment, which "
            "the pool had none of to lend: give the pool room for one more connection, or "
            "pass a DSN"
        )
    try:
        await other.prepare()
        # Other clients of the pooler may be busy at the same moment and change
        # which server session each of ours gets; a few rounds make that moot.
        # Directly or in session mode no round can ever look pooled.
        for _ in range(3):
            other_pid = int(await other.fetchval(query("holder_backend_pid")))
            again = int(await conn.fetchval(query("holder_backend_pid")))
            if again != conn.backend_pid or other_pid == conn.backend_pid:
                return True
        return False
    finally:
        await other.give_back()
