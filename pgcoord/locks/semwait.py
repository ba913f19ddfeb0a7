"""A semaphore waiter's connection: statements outside any transaction, and
waiting for the notification that a lane was freed.

``pgcoord.semaphore()`` waits on the caller's own connection (checked out of
its pool, or given), before its transaction begins: it LISTENs, tries, and
waits for a notification on channel ``pgcoord_semaphores`` whose payload is the
semaphore's key. asyncpg delivers notifications whenever they arrive. psycopg
reads them only while it runs a statement, so while nothing runs the waiter
watches the socket itself (a selector) and hands what arrives to psycopg's notify handlers,
as psycopg would. SQLAlchemy connections are waited on through their driver's.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from typing import Any

from .._core.queries import to_pyformat
from .._drivers.adapt import driver_of

CHANNEL = "pgcoord_semaphores"
_LISTEN = f"LISTEN {CHANNEL}"
_BACKEND_PID = "SELECT pg_catalog.pg_backend_pid()"


class _Wake:
    """Notifications for one key; other keys on the channel are not ours."""

    def __init__(self, key: int) -> None:
        self.payload = str(key)
        self.woken = False

    def psycopg(self, notify: Any) -> None:
        if notify.channel == CHANNEL and notify.payload == self.payload:
            self.woken = True


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _LaneConn:
    #: The drivers whose connections a wait can hear notifications on; on others
    #: (psycopg2, pg8000 under SQLAlchemy) it retries.
    DRIVERS: tuple[str, ...]

    @classmethod
    def can_wait_on(cls, conn: Any) -> bool:
        """Whether a wait can hear notifications on this driver connection."""
        return driver_of(conn) in cls.DRIVERS


class AsyncLaneConn(_LaneConn):
    """An async driver connection used for a semaphore wait (asyncpg or psycopg)."""

    DRIVERS = ("asyncpg", "psycopg")

    def __init__(self, conn: Any, key: int) -> None:
        self.conn = conn
        self.module = driver_of(conn)
        if self.module not in self.DRIVERS:
            raise TypeError(f"cannot wait on a {type(conn).__qualname__}")
        self._wake = _Wake(key)
        self._event = asyncio.Event()
        self._listening = False

    def _on_asyncpg(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        if payload == self._wake.payload:
            self._event.set()

    def _on_psycopg(self, notify: Any) -> None:
        self._wake.psycopg(notify)
        if self._wake.woken:
            self._event.set()

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """One ``$n`` statement in a transaction of its own; its first value."""
        if self.module == "asyncpg":
            return await self.conn.fetchval(sql, *args)
        from .._drivers.psycopg import CANCEL_GRACE, guard_cancel

        return await guard_cancel(self.conn, self._psycopg_fetchval(sql, args), grace=CANCEL_GRACE)

    async def _psycopg_fetchval(self, sql: str, args: tuple[Any, ...]) -> Any:
        from .._drivers.psycopg import synced

        conn = self.conn
        switched = not conn.autocommit
        try:
            if switched:  # psycopg then sends no BEGIN (in pipeline mode: a sync)
                await conn.set_autocommit(True)
            async with synced(conn):
                cur = await conn.execute(to_pyformat(sql), args or None, prepare=False)
            row = await cur.fetchone() if cur.description else None
            return None if row is None else row[0]
        finally:
            if switched and conn.autocommit and not conn.closed:
                await conn.set_autocommit(False)

    def announced_pid(self) -> int:
        """The server process id announced at connect (a pooler announces its own)."""
        if self.module == "asyncpg":
            return int(self.conn.get_server_pid())
        return int(self.conn.info.backend_pid)

    async def behind_pooler(self) -> bool:
        """Whether a pooler stands between us and the server: then the next
        statement may run on another server session, and nothing may be left
        at session level (see pgcoord.semaphores)."""
        return bool(await self.fetchval(_BACKEND_PID) != self.announced_pid())

    async def listen(self) -> None:
        if self.module == "asyncpg":
            await self.conn.add_listener(CHANNEL, self._on_asyncpg)
        else:
            self.conn.add_notify_handler(self._on_psycopg)
            self._listening = True
            await self.fetchval(_LISTEN)
        self._listening = True

    async def wait(self, seconds: float) -> None:
        """Until a notification for our key, or ``timeout`` seconds."""
        if not self._event.is_set():
            if self.module == "asyncpg":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._event.wait(), seconds)
            else:
                await self._wait_psycopg(seconds)
        self._event.clear()

    async def _wait_psycopg(self, seconds: float) -> None:
        from .._drivers.psycopg import read_notifications

        # Every semaphore's releases go to one channel: read on until one is ours.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        fd = self.conn.pgconn.socket
        while not self._event.is_set() and (remaining := deadline - loop.time()) > 0:
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, readable)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(readable, remaining)
            finally:
                loop.remove_reader(fd)
            if not readable.done():
                return
            read_notifications(self.conn)
            if self.conn.closed:
                return  # the next statement raises as psycopg does

    async def forget(self) -> None:
        """Stop hearing notifications, once the server stopped listening (the
        statement that got a lane or gave up ran UNLISTEN)."""
        if not self._listening:
            return
        self._listening = False
        if self.module == "asyncpg":
            # asyncpg sends an UNLISTEN of its own when its last callback goes.
            if not self.conn.is_closed():
                await self.conn.remove_listener(CHANNEL, self._on_asyncpg)
        else:
            from .._drivers.psycopg import purge_backlog

            with contextlib.suppress(ValueError):
                self.conn.remove_notify_handler(self._on_psycopg)
            purge_backlog(self.conn, CHANNEL)


class SyncLaneConn(_LaneConn):
    """:class:`AsyncLaneConn` for a psycopg sync connection."""

    DRIVERS = ("psycopg",)

    def __init__(self, conn: Any, key: int) -> None:
        self.conn = conn
        if not self.can_wait_on(conn):
            raise TypeError(f"cannot wait on a {type(conn).__qualname__}")
        self._wake = _Wake(key)
        self._listening = False

    def fetchval(self, sql: str, *args: Any) -> Any:
        from .._drivers.psycopg import synced

        conn = self.conn
        switched = not conn.autocommit
        if switched:
            conn.autocommit = True
        try:
            with synced(conn):
                cur = conn.execute(to_pyformat(sql), args or None, prepare=False)
            row = cur.fetchone() if cur.description else None
            return None if row is None else row[0]
        finally:
            if switched and not conn.closed:
                conn.autocommit = False

    def behind_pooler(self) -> bool:
        return bool(self.fetchval(_BACKEND_PID) != int(self.conn.info.backend_pid))

    def listen(self) -> None:
        self.conn.add_notify_handler(self._wake.psycopg)
        self._listening = True
        self.fetchval(_LISTEN)

    def wait(self, timeout: float) -> None:
        from .._drivers.psycopg import read_notifications

        deadline = time.monotonic() + timeout
        # A selector, not select.select(): that refuses descriptors >= FD_SETSIZE.
        with selectors.DefaultSelector() as watch:
            watch.register(self.conn.pgconn.socket, selectors.EVENT_READ)
            while not self._wake.woken and (remaining := deadline - time.monotonic()) > 0:
                if not watch.select(remaining):
                    break
                read_notifications(self.conn)
                if self.conn.closed:
                    break
        self._wake.woken = False

    def forget(self) -> None:
        if not self._listening:
            return
        self._listening = False
        from .._drivers.psycopg import purge_backlog

        with contextlib.suppress(ValueError):
            self.conn.remove_notify_handler(self._wake.psycopg)
        purge_backlog(self.conn, CHANNEL)
