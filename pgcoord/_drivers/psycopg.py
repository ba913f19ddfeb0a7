"""psycopg 3: ``AsyncConnectionPool``, ``AsyncConnection``, ``ConnectionPool``, ``Connection``.

psycopg sends its own BEGIN in a round trip of its own before a connection's
first statement. To have BEGIN and the lock share one, pgcoord switches the
connection to autocommit (psycopg then sends no BEGIN), sends ``BEGIN; <lock>``
as one simple-protocol message, and switches autocommit back off once the
transaction has ended. psycopg follows the server's transaction status, so in
the body statements run in that transaction and ``conn.transaction()`` makes
savepoints as usual; ``conn.autocommit`` reads True until the block ends.

Pipeline mode would also let them share a round trip, but entering and leaving
it cost more than the round trip saves (bench/locks.py measured about 40% fewer
acquisitions per second). A connection the caller already has in pipeline mode
cannot run a multi-statement message, and takes BEGIN and the lock separately.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

import psycopg
from psycopg.pq import PipelineStatus, TransactionStatus

from .._core.aio import consume_result
from .._core.queries import to_pyformat
from .adapt import Adapter
from .base import AsyncTxSession, LockStatement, SyncTxSession, begin_and_lock, begin_statement
from .protocol import DedicatedSession, Lender, SessionSource

try:
    import psycopg_pool
except ImportError:  # psycopg without psycopg-pool: connections only
    psycopg_pool = None  # type: ignore[assignment]

ASYNC_CONNECTION_TYPES: tuple[type, ...] = (psycopg.AsyncConnection,)
SYNC_CONNECTION_TYPES: tuple[type, ...] = (psycopg.Connection,)
ASYNC_POOL_TYPES: tuple[type, ...] = (
    (psycopg_pool.AsyncConnectionPool,) if psycopg_pool is not None else ()
)
SYNC_POOL_TYPES: tuple[type, ...] = (
    (psycopg_pool.ConnectionPool,) if psycopg_pool is not None else ()
)


def _in_transaction(conn: Any) -> bool:
    # pgconn's status is a plain int; conn.info builds an object and an enum per call.
    return bool(conn.pgconn.transaction_status != TransactionStatus.IDLE)


class PsycopgAdapter(Adapter):
    driver = "psycopg"
    __slots__ = ()

    def reports_hot_standby(self, conn: Any) -> bool:
        return bool(conn.info.parameter_status("in_hot_standby") == "on")

    async def fetchval_on(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        async with synced(conn):
            cur = await conn.execute(to_pyformat(sql), params)
        row = await cur.fetchone() if cur.description else None
        return None if row is None else row[0]

    def fetchval_on_sync(self, conn: Any, sql: str, params: tuple[Any, ...]) -> Any:
        with synced(conn):
            cur = conn.execute(to_pyformat(sql), params)
        row = cur.fetchone() if cur.description else None
        return None if row is None else row[0]

    def in_transaction(self, conn: Any) -> bool | None:
        status = conn.info.transaction_status
        if status == TransactionStatus.IDLE:
            return False
        if status in (TransactionStatus.INTRANS, TransactionStatus.INERROR):
            return True
        return None  # ACTIVE (a statement in flight) or UNKNOWN (a broken connection)

    def pool_capacity(self, source: Any) -> int | None:
        if not self.is_pool:
            return None
        return int(source.max_size) or None  # 0: an AsyncNullConnectionPool without a bound

    def dedicated(self, conn: Any, lender: Lender | None) -> DedicatedSession:
        if self.is_pool or not self.is_async:
            return super().dedicated(conn, lender)
        from .psycopg_dedicated import PsycopgDedicated

        return PsycopgDedicated(conn, lender)

    def dedicated_source(self, pool: Any) -> SessionSource:
        if not (self.is_pool and self.is_async):
            return super().dedicated_source(pool)
        from .psycopg_dedicated import PsycopgPoolSessions

        return PsycopgPoolSessions(pool)


def classify(cls: type) -> Adapter | None:
    for types, is_async, is_pool, session in (
        (ASYNC_POOL_TYPES, True, True, AsyncPsycopgSession),
        (ASYNC_CONNECTION_TYPES, True, False, AsyncPsycopgSession),
        (SYNC_POOL_TYPES, False, True, SyncPsycopgSession),
        (SYNC_CONNECTION_TYPES, False, False, SyncPsycopgSession),
    ):
        if types and issubclass(cls, types):
            return PsycopgAdapter(cls, is_async=is_async, is_pool=is_pool, session=session)
    return None


def is_pool_timeout(exc: BaseException) -> bool:
    return psycopg_pool is not None and isinstance(exc, psycopg_pool.PoolTimeout)


def is_connect_error(exc: BaseException) -> bool:
    # psycopg reports a failed connect (refused, timed out, login refused) or a
    # lost one without a SQLSTATE.
    return isinstance(exc, psycopg.OperationalError)


def _mode(conn: Any) -> tuple[str | None, bool | None, bool | None]:
    """The connection's own transaction characteristics, as its BEGIN would carry them."""
    level = conn.isolation_level
    isolation = None if level is None else psycopg.IsolationLevel(level).name.replace("_", " ")
    return isolation, conn.read_only, conn.deferrable


def _one_message(conn: Any, lock: LockStatement) -> str:
    """``BEGIN; <lock>`` with the connection's own transaction characteristics."""
    return begin_and_lock(lock, *_mode(conn))


def _drained(conn: Any) -> None:
    """After a pipeline sync whose errors were let pass before a rollback: they
    were the body's statements' own (a failed insert it queued), which the
    rollback undoes anyway. A connection that broke meanwhile must not go back:
    its error is raised, and the caller discards it."""
    if conn.closed or conn.pgconn.status != psycopg.pq.ConnStatus.OK:
        raise psycopg.OperationalError("the connection broke while its pipeline was read")


def _pending(conn: Any) -> bool:
    """Whether statements sent or queued in the connection's pipeline are still
    unanswered. libpq then reads ACTIVE, whatever the transaction will be once
    they are read; and psycopg queues its own BEGIN or COMMIT without sending it
    until the next statement. If psycopg's queue moved, a sync is assumed needed
    (one round trip)."""
    if conn.pgconn.pipeline_status == PipelineStatus.OFF:
        return False
    if conn.pgconn.transaction_status == TransactionStatus.ACTIVE:
        return True
    queue = getattr(getattr(conn, "_pipeline", None), "command_queue", None)
    return queue is None or bool(queue)


def _begin(conn: Any) -> str:
    """The BEGIN psycopg would send, for a pipeline (one statement at a time)."""
    return begin_statement(*_mode(conn))


def synced(conn: Any) -> Any:
    """A context at whose end the statements run in it have been answered.

    In pipeline mode a statement is only queued: pgcoord would return before the
    server granted a lock or checked a fence, and a refusal would surface later
    as a psycopg error at some statement of the caller's. A nested pipeline
    block sends a Sync at its end and reads every result, so the lock is
    granted, or refused with its own error, before pgcoord returns. Out of
    pipeline mode nothing is needed (a block would enter pipeline mode for one
    statement, which costs round trips)."""
    if conn.pgconn.pipeline_status == PipelineStatus.OFF:
        return contextlib.nullcontext()
    return conn.pipeline()


def _in_savepoint(conn: Any, lock: LockStatement) -> tuple[tuple[str, Any], ...]:
    """The lock's statements and parameters for a savepoint of the caller's: the
    simple-protocol message (a wait then keeps statement_timeout off itself), or
    its statements one by one in pipeline mode, which takes one at a time."""
    if conn.pgconn.pipeline_status == PipelineStatus.OFF:
        return ((lock.inline, None),)
    return tuple((to_pyformat(sql), params) for sql, params in lock.pipelined())


T = TypeVar("T")

# psycopg before 3.2 answers the cancellation of a statement with libpq's
# blocking cancel request (PQcancel), on the event loop's thread and holding the
# GIL: over a network that does not answer, the whole process stops for good.
# There, a cancellation does not reach pgcoord's own statements (guard_cancel).
BLOCKING_CANCEL = not hasattr(psycopg.AsyncConnection, "cancel_safe")

# psycopg 3.2 cancels without blocking, but over a network that does not answer
# it then waits for the statement's result for ever (measured here with 3.2.3 and
# 3.2.13: test_cancelling_a_psycopg_statement_on_a_silent_network_does_not_stop_the_loop).
# 3.3 gives up. Before 3.3 pgcoord therefore keeps cancellations away from its own
# statements and closes the connection instead (guard_cancel).
GUARD_CANCEL = BLOCKING_CANCEL or tuple(
    int(part) for part in psycopg.__version__.split(".")[:2] if part.isdigit()) < (3, 3)

# How long a short statement whose caller was cancelled may take to end by
# itself before its connection is closed under it (a lock wait gets none).
CANCEL_GRACE = 0.25


async def guard_cancel(conn: Any, op: Coroutine[Any, Any, T], *, grace: float) -> T:
    """Run ``op``, a statement on the async connection ``conn``.

    On psycopg before 3.2 the caller's cancellation is not passed on to it: it
    is given ``grace`` seconds to end by itself, then the connection is closed
    under it, which fails it at once with no cancel request; the caller gets its
    CancelledError. The price, on that version only: the connection is
    discarded, and a cancelled lock wait stays queued on the server until the
    lock is granted to it, when its session notices it is gone and ends (in
    milliseconds). Elsewhere ``op`` is simply awaited.
    """
    if not GUARD_CANCEL:
        return await op
    task = asyncio.ensure_future(op)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            if grace > 0 and not task.done():
                await asyncio.wait([task], timeout=grace)
        finally:
            if not task.done():
                sever_async(conn)
                task.cancel()
            task.add_done_callback(consume_result)
        raise


def sever_async(conn: Any) -> None:
    """Close an async connection's libpq connection at once, from the event loop.

    The socket goes with it (the server ends the session and its locks); psycopg
    then finds the connection closed and a pool drops it. The loop's watch on the
    socket is removed first, so that a later socket that gets the same descriptor
    number is not mistaken for this one. A socket shutdown alone would not do:
    psycopg before 3.2 answers the cancellation of an abandoned cleanup with a
    blocking PQcancel, a network round trip on the event loop's thread, which a
    closed connection (no cancel key) avoids.
    """
    pgconn = conn.pgconn
    try:
        fd = pgconn.socket
    except Exception:  # already closed
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        loop.remove_reader(fd)
        loop.remove_writer(fd)
    pgconn.finish()


def read_notifications(conn: Any) -> None:
    """Parse what arrived on an idle connection; notifications go to its notify
    handlers, as in psycopg's own reads. A connection the server closed is found
    closed by psycopg's next statement, which then raises as usual."""
    pgconn = conn.pgconn
    with contextlib.suppress(Exception):
        pgconn.consume_input()
    while (notify := pgconn.notifies()) is not None:
        handler = pgconn.notify_handler
        if handler is not None:
            handler(notify)


def purge_backlog(conn: Any, channel: str) -> None:
    """psycopg 3.3 keeps notifications that arrive outside ``notifies()`` for a
    later ``notifies()`` call: those of ``channel`` must not reach the
    connection's next user."""
    backlog = getattr(conn, "_notifies_backlog", None)
    if backlog:
        kept = [n for n in backlog if n.channel != channel]
        backlog.clear()
        backlog.extend(kept)


def sever_sync(conn: Any) -> None:
    """Shut a sync connection's socket down, from any thread.

    A statement blocked on it returns with an error at once and psycopg marks the
    connection broken; the descriptor stays open (psycopg closes it), so no other
    socket can take its number while that statement still waits on it.
    """
    try:
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
    except Exception:  # already closed
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


class AsyncOneTrip:
    """An async connection's transaction opened together with its lock."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self._autocommit_switched = False

    async def begin_locked(self, lock: LockStatement) -> None:
        # In autocommit psycopg sends no BEGIN of its own, and after the body a
        # transaction the body ended itself stays ended (the block then says so).
        if not self.conn.autocommit:
            # Marked first: set_autocommit may yield (in pipeline mode it syncs, a
            # round trip), and a cancellation there may come after the switch.
            self._autocommit_switched = True
            await self.conn.set_autocommit(True)
        if self.conn.pgconn.pipeline_status == PipelineStatus.OFF:
            await guard_cancel(self.conn, self.conn.execute(_one_message(self.conn, lock),
                                                            prepare=False), grace=0)
        else:
            await guard_cancel(self.conn, self._begin_pipelined(lock), grace=0)

    async def _begin_pipelined(self, lock: LockStatement) -> None:
        async with self.conn.pipeline():  # one Sync: answered before the body runs
            await self.conn.execute(_begin(self.conn), prepare=False)
            for sql, params in lock.pipelined():
                await self.conn.execute(to_pyformat(sql), params, prepare=False)

    async def commit(self) -> None:
        await self.conn.commit()
        await self.restore_autocommit()

    async def rollback(self) -> None:
        if self.conn.pgconn.pipeline_status != PipelineStatus.OFF:
            with contextlib.suppress(psycopg.Error):  # the body's own: see _drained
                async with self.conn.pipeline():
                    pass
            _drained(self.conn)
        if _in_transaction(self.conn):
            await self.conn.rollback()
        await self.restore_autocommit()

    async def restore_autocommit(self) -> None:
        if self._autocommit_switched:
            self._autocommit_switched = False
            if self.conn.autocommit:  # not if the switch itself was cut short
                await self.conn.set_autocommit(False)


class SyncOneTrip:
    """:class:`AsyncOneTrip` for a sync connection."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._autocommit_switched = False

    def begin_locked(self, lock: LockStatement) -> None:
        if not self.conn.autocommit:
            self._autocommit_switched = True
            self.conn.autocommit = True
        if self.conn.pgconn.pipeline_status == PipelineStatus.OFF:
            self.conn.execute(_one_message(self.conn, lock), prepare=False)
            return
        with self.conn.pipeline():  # one Sync: answered before the body runs
            self.conn.execute(_begin(self.conn), prepare=False)
            for sql, params in lock.pipelined():
                self.conn.execute(to_pyformat(sql), params, prepare=False)

    def commit(self) -> None:
        self.conn.commit()
        self.restore_autocommit()

    def rollback(self) -> None:
        if self.conn.pgconn.pipeline_status != PipelineStatus.OFF:
            with contextlib.suppress(psycopg.Error), self.conn.pipeline():  # see _drained
                pass
            _drained(self.conn)
        if _in_transaction(self.conn):
            self.conn.rollback()
        self.restore_autocommit()

    def restore_autocommit(self) -> None:
        if self._autocommit_switched:
            self._autocommit_switched = False
            if self.conn.autocommit:
                self.conn.autocommit = False


class AsyncPsycopgSession(AsyncTxSession):
    def __init__(self, source: Any) -> None:
        self._pool: Any = source if isinstance(source, ASYNC_POOL_TYPES) else None
        self.pooled = self._pool is not None
        self.conn: psycopg.AsyncConnection[Any] | None = None if self._pool else source
        self._trip: AsyncOneTrip | None = None

    async def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = await self._pool.getconn()
        else:
            await self.settle()  # the caller's statements still queued in a pipeline
        return self.conn

    async def settle(self) -> None:
        # Not under guard_cancel: what is waited for here is the caller's (or the
        # body's) own statements, and a cancellation treats them as it would have
        # had the caller awaited them itself (guard_cancel would close the
        # connection and leave them running on the server, the lock held).
        assert self.conn is not None
        if _pending(self.conn):
            async with self.conn.pipeline():
                pass

    def in_transaction(self) -> bool:
        return _in_transaction(self.conn)

    def driver_connection(self) -> Any:
        return self.conn

    async def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        return await guard_cancel(self.conn, self._run_autocommit(sql, params), grace=CANCEL_GRACE)

    async def _run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        async with self.conn.transaction():
            async with synced(self.conn):
                cur = await self.conn.execute(to_pyformat(sql), params)
            return await cur.fetchone() if cur.description else None

    async def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._trip = AsyncOneTrip(self.conn)
        await self._trip.begin_locked(lock)

    async def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        await guard_cancel(self.conn, self._lock_in_savepoint(lock), grace=0)

    async def _lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        async with self.conn.transaction(), synced(self.conn):
            for sql, params in _in_savepoint(self.conn, lock):
                await self.conn.execute(sql, params)

    async def commit(self) -> None:
        # The trip is kept until it has switched autocommit back: after a failed
        # COMMIT (deferred constraint, serialization failure, cancellation) the
        # rollback that follows must still do it.
        if self._trip is not None:
            await self._trip.commit()
            self._trip = None

    async def rollback(self) -> None:
        assert self.conn is not None
        if self._trip is not None:
            await self._trip.rollback()
            self._trip = None
        elif _in_transaction(self.conn):
            await self.conn.rollback()

    async def discard(self) -> None:
        self._trip = None
        if self.conn is not None:
            await self.conn.close()

    async def checkin(self) -> None:
        if self._pool is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            await self._pool.putconn(conn)

    def sever(self) -> None:
        if self.conn is not None:
            sever_async(self.conn)


class SyncPsycopgSession(SyncTxSession):
    def __init__(self, source: Any) -> None:
        self._pool: Any = source if isinstance(source, SYNC_POOL_TYPES) else None
        self.pooled = self._pool is not None
        self.conn: psycopg.Connection[Any] | None = None if self._pool else source
        self._trip: SyncOneTrip | None = None

    def checkout(self) -> Any:
        if self._pool is not None:
            self.conn = self._pool.getconn()
        else:
            self.settle()
        return self.conn

    def settle(self) -> None:
        assert self.conn is not None
        if _pending(self.conn):
            with self.conn.pipeline():
                pass

    def in_transaction(self) -> bool:
        return _in_transaction(self.conn)

    def driver_connection(self) -> Any:
        return self.conn

    def run_autocommit(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self.conn is not None
        with self.conn.transaction(), synced(self.conn):
            cur = self.conn.execute(to_pyformat(sql), params)
            return cur.fetchone() if cur.description else None

    def begin_locked(self, lock: LockStatement) -> None:
        assert self.conn is not None
        self._trip = SyncOneTrip(self.conn)
        self._trip.begin_locked(lock)

    def lock_in_savepoint(self, lock: LockStatement) -> None:
        assert self.conn is not None
        with self.conn.transaction(), synced(self.conn):
            for sql, params in _in_savepoint(self.conn, lock):
                self.conn.execute(sql, params)

    def commit(self) -> None:
        if self._trip is not None:  # kept until autocommit is back; see the async twin
            self._trip.commit()
            self._trip = None

    def rollback(self) -> None:
        assert self.conn is not None
        if self._trip is not None:
            self._trip.rollback()
            self._trip = None
        elif _in_transaction(self.conn):
            self.conn.rollback()

    def discard(self) -> None:
        self._trip = None
        if self.conn is not None:
            self.conn.close()

    def checkin(self) -> None:
        if self._pool is not None and self.conn is not None:
            conn, self.conn = self.conn, None
            self._pool.putconn(conn)

    def sever(self) -> None:
        conn = self.conn
        if conn is not None:
            sever_sync(conn)
