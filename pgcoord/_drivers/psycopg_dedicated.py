"""A psycopg ``AsyncConnection`` as a ``DedicatedSession``: its socket watched
while idle (so that its loss and its notifications are heard at once), and
cancellations that never stop the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg
from psycopg.pq import ConnStatus

from .._core.aio import consume_result
from .._core.queries import to_pyformat
from ..errors import PoolExhausted
from .protocol import LEND_TIMEOUT, DedicatedSession, Lender, SessionSource, Unlisten
from .psycopg import CANCEL_GRACE, GUARD_CANCEL, purge_backlog

log = logging.getLogger("pgcoord.session")

T = TypeVar("T")


class PsycopgDedicated(DedicatedSession):
    """A psycopg ``AsyncConnection``, with its socket watched while it is idle.

    psycopg reads from the socket only while a statement runs, so on its own it
    would learn that the server ended the session only at the next statement.
    While no statement is in flight this class registers a reader for the
    socket on the event loop; when the socket becomes readable it consumes what
    arrived as psycopg would (notifications go to the connection's notify
    handlers, a server error to its notice handlers) and, if the connection is
    now closed, calls the ``on_lost`` callbacks.

    asyncio allows one reader per file descriptor and psycopg's own waits add
    and remove a reader on the same one, so every operation goes through
    ``_enter``/``_leave``: the watch is disarmed before psycopg touches the
    socket and armed again once the last operation in flight is over.
    """

    def __init__(self, conn: Any, lender: Lender | None) -> None:
        self.conn = conn
        self._blocking_cancel = GUARD_CANCEL  # see _drivers.psycopg: psycopg before 3.3
        self._lender = lender
        self._ok = ConnStatus.OK
        self._restore_autocommit = False
        self._op_lock: asyncio.Lock | None = None
        self._shielded: set[asyncio.Future[Any]] = set()  # psycopg < 3.2: see _run
        self._busy = 0  # operations in flight
        self._idle: asyncio.Event | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._watched_fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = False  # lost, closed or given back: no more watching
        self._finish_when_idle = False

    # -- the watch ---------------------------------------------------------------

    def on_lost(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if not self._busy:
            self._arm()

    def _arm(self) -> None:
        if self._watched_fd >= 0 or self._done or not self._callbacks:
            return
        pgconn = self.conn.pgconn
        if pgconn.status != self._ok:
            self._report_lost()
            return
        fd = pgconn.socket
        assert self._loop is not None
        self._loop.add_reader(fd, self._readable)
        self._watched_fd = fd

    def _disarm(self) -> None:
        fd, self._watched_fd = self._watched_fd, -1
        if fd >= 0 and self._loop is not None:
            self._loop.remove_reader(fd)

    def _readable(self) -> None:
        # Disarm first: on end of file libpq closes the socket, and a reader
        # left registered for a closed descriptor would be inherited by the
        # next socket to get its number.
        self._disarm()
        pgconn = self.conn.pgconn
        try:
            pgconn.consume_input()
        except Exception:
            pass  # the status below tells what happened
        else:
            # Parse what arrived: notices reach the notice handler as they are
            # parsed, notifications the notify handler, as in psycopg's own reads.
            while (notify := pgconn.notifies()) is not None:
                handler = pgconn.notify_handler
                if handler is not None:
                    try:
                        handler(notify)
                    except Exception:
                        log.exception("pgcoord: a notification handler failed")
        if pgconn.status != self._ok:
            self._report_lost()
        elif not self._busy:
            self._arm()

    def _report_lost(self) -> None:
        if self._done:
            return
        self._done = True
        self._disarm()
        for callback in self._callbacks:
            try:
                callback()
            except Exception:
                log.exception("pgcoord: a connection-lost callback failed")

    def _enter(self) -> None:
        self._busy += 1
        if self._watched_fd >= 0:
            self._disarm()

    def _leave(self) -> None:
        self._busy -= 1
        if self._busy:
            return
        if self._finish_when_idle:
            self.conn.pgconn.finish()
        if self._idle is not None:
            self._idle.set()
        if self._callbacks and not self._done:
            self._arm()

    # -- statements ----------------------------------------------------------------

    async def prepare(self) -> None:
        # Session locks are taken outside transactions: a pooled connection
        # without autocommit gets it for the holder's lifetime.
        if not self.conn.autocommit:
            await self._run(self._op(self.conn.set_autocommit, True), blocking=False)
            self._restore_autocommit = True

    async def fetchval(self, sql: str, *args: Any) -> Any:
        row = await self._run(self._op(self._fetchrow, sql, args), blocking=False)
        return None if row is None else row[0]

    async def fetchrow(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        return await self._run(self._op(self._fetchrow, sql, args), blocking=False)

    async def _fetchrow(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        cur = await self.conn.execute(to_pyformat(sql), args or None)
        if cur.description is None:
            # A statement with no result (an INSERT without RETURNING): psycopg's
            # fetchone() would raise a ProgrammingError, with no SQLSTATE, which reads
            # as a broken session and loses every lock held on it.
            return None
        row: tuple[Any, ...] | None = await cur.fetchone()
        return row

    async def execute(self, sql: str) -> None:
        await self._run(self._op(self.conn.execute, sql), blocking=False)

    async def execute_blocking(self, sql: str) -> None:
        await self._run(self._op(self.conn.execute, sql), blocking=True)

    async def _op(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """One operation on the connection, one at a time. A connection closed at
        our end (``terminate``/``abort``) is refused here: psycopg < 3.2 would
        send on a finished connection, which crashes the process."""
        if self._op_lock is None:
            self._op_lock = asyncio.Lock()
        async with self._op_lock:
            if self.conn.pgconn.status != self._ok:
                raise psycopg.OperationalError("the connection is closed")
            self._enter()
            try:
                return await fn(*args)
            finally:
                self._leave()

    async def _run(self, op: Coroutine[Any, Any, T], blocking: bool) -> T:
        """Run one psycopg operation. psycopg < 3.2 answers a cancellation by
        sending a cancel request with a blocking call on the event loop, which
        over a network that does not answer blocks it for good. There the
        operation runs in a task of its own that a cancellation does not reach:
        it is given ``CANCEL_GRACE`` seconds to end by itself (none for a
        ``blocking`` statement), then the connection is closed under it."""
        if not self._blocking_cancel:
            return await op
        task = asyncio.ensure_future(op)
        self._shielded.add(task)
        task.add_done_callback(self._shielded.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            try:
                if not blocking and not task.done():
                    await asyncio.wait([task], timeout=CANCEL_GRACE)
            finally:
                if not task.done():
                    # Closed, the connection fails the cancel request at once.
                    self.abort()
                    task.cancel()
                task.add_done_callback(consume_result)
            raise

    async def listen(self, channel: str, callback: Callable[[str], None]) -> Unlisten:
        # psycopg hands notifications to its notify handlers as it reads them:
        # during a statement, or from the idle watch (_readable).
        conn = self.conn

        def on_notify(notify: Any) -> None:
            if notify.channel == channel:
                callback(notify.payload)

        conn.add_notify_handler(on_notify)
        await self.execute(f'LISTEN "{channel}"')

        async def unlisten(*, lost: bool = False) -> None:
            with contextlib.suppress(ValueError):
                conn.remove_notify_handler(on_notify)
            purge_backlog(conn, channel)

        return unlisten

    def announced_pid(self) -> int | None:
        return int(self.conn.info.backend_pid)

    # -- ending --------------------------------------------------------------------

    def terminate(self) -> None:
        self._done = True
        self._disarm()
        pgconn = self.conn.pgconn
        if pgconn.status != self._ok:
            return
        if not self._busy:
            # Not conn.close(): with a pool's close_returns that would return it.
            # finish() sends Terminate without blocking and closes the socket;
            # the connection then reads as closed to psycopg and to its pool.
            pgconn.finish()
            return
        # A statement is in flight and psycopg waits on this socket: closing
        # the descriptor under the wait would strand it. Shut the socket down
        # instead: the server sees end of file and ends the session, the wait
        # sees it too and libpq closes the socket in order; the rest is
        # finished when the last statement is over.
        self._finish_when_idle = True
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def abort(self) -> None:
        self._done = True
        self._disarm()
        pgconn = self.conn.pgconn
        if pgconn.status != self._ok:
            return
        # The wait in flight has a reader or writer on this socket: take them
        # off first (its own finally then finds nothing to remove), so no
        # registration outlives the descriptor; the cancellation wakes it. A
        # closed connection also keeps psycopg < 3.2 from sending a blocking
        # cancel request over a network that may not answer.
        fd = pgconn.socket
        loop = self._loop or asyncio.get_running_loop()
        loop.remove_reader(fd)
        loop.remove_writer(fd)
        pgconn.finish()
        # An operation run apart from its caller's cancellation (see _run) is
        # cancelled with the connection: psycopg must never resume a statement on
        # a finished connection (psycopg < 3.2 would read from a freed one).
        for task in self._shielded:
            task.cancel()

    async def close_now(self) -> None:
        self.terminate()
        if self._busy:
            # The statements in flight end at once on the closed socket.
            if self._idle is None:
                self._idle = asyncio.Event()
            self._idle.clear()
            await self._idle.wait()
        if self._lender is not None:
            await self._lender.discard(self.conn)

    async def give_back(self) -> None:
        self._done = True
        self._disarm()
        if self._restore_autocommit and not self.conn.closed:
            await self._op(self.conn.set_autocommit, False)
        if self._lender is None:
            await self.conn.close()
        else:
            await self._lender.give_back(self.conn)


class _PsycopgLender(Lender):
    def __init__(self, pool: Any) -> None:
        self.pool = pool

    async def give_back(self, driver_conn: Any) -> None:
        await self.pool.putconn(driver_conn)

    async def discard(self, driver_conn: Any) -> None:
        # putconn() sees a closed connection, drops it and opens a replacement.
        await self.pool.putconn(driver_conn)


class PsycopgPoolSessions(SessionSource):
    """Dedicated sessions borrowed from a psycopg ``AsyncConnectionPool``."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._lender = _PsycopgLender(pool)

    async def open(self) -> DedicatedSession:
        import psycopg_pool  # not at the top: psycopg works without psycopg-pool

        try:
            conn = await self.pool.getconn()
        except psycopg_pool.PoolTimeout as exc:
            raise PoolExhausted(
                f"the psycopg pool lent no connection to LockHolder within its timeout: {exc}"
            ) from exc
        return PsycopgDedicated(conn, self._lender)

    async def open_now(self) -> DedicatedSession | None:
        import psycopg_pool

        pool = self.pool
        stats = pool.get_stats()
        if stats.get("pool_available", 0) == 0 and stats.get("pool_size", 0) >= pool.max_size:
            return None
        try:
            conn = await pool.getconn(timeout=LEND_TIMEOUT)
        except psycopg_pool.PoolTimeout:
            return None
        return PsycopgDedicated(conn, self._lender)
