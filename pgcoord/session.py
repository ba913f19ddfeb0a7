"""``LockHolder``: session advisory locks on dedicated connections.

Session locks outlive transactions, so long work need not hold one open. They
also outlive the code that took them, which is why every pool makes them
dangerous (asyncpg's unlocks all on release, psycopg's and SQLAlchemy's leak
them to the next user). A ``LockHolder`` therefore takes them only on
connections it owns or has borrowed for its lifetime, and gives a borrowed one
back only after ``pg_locks`` shows it holds nothing.

Layout: one *main* connection carries every lock that is free when asked for
(``pg_try_advisory_lock``), so it is never blocked and stays free for unlocks and
liveness probes. A lock that must be waited for is waited for on a connection of
its own, which then carries that one lock until it is released. Each connection
is probed every ``keepalive / 2`` seconds; when one is lost, every body holding
a lock on it is cancelled and its ``async with`` raises ``LockLost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import Any

from . import _errmap, metrics
from ._aio import CLEANUP_TIMEOUT, absorb_cancel, consume_result, finish_despite_cancel
from ._holderconn import (
    ConnectionSource,
    HolderConnection,
    behind_transaction_pooler,
    connection_source,
)
from ._keys import LockKeyLike
from ._queries import query
from .errors import LockBusy, LockLost, LockTimeout, PgcoordError, UnsupportedConnection
from .locks import LockRequest

__all__ = ["HeldLock", "LockHolder"]

log = logging.getLogger("pgcoord.session")

class _Carrier:
    """One connection and the locks it carries."""

    def __init__(self, conn: HolderConnection, holder: LockHolder, *, dedicated: bool) -> None:
        self.conn = conn
        self.holder = holder
        self.dedicated = dedicated
        self.lost_reason: str | None = None
        self.holding: dict[HeldLock, asyncio.Task[Any]] = {}
        self._io = asyncio.Lock()
        self._probe: asyncio.Task[None] | None = None
        conn.on_lost(lambda: self.mark_lost("the server closed the connection"))

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    async def fetchval(self, sql: str, *args: Any) -> Any:
        if self.lost:
            raise LockLost(f"session lost: {self.lost_reason}")
        try:
            async with self._io:
                return await self.conn.fetchval(sql, *args)
        except BaseException as exc:
            if _errmap.session_gone(exc):
                self.mark_lost(f"{type(exc).__name__}: {exc}")
            raise

    async def execute(self, sql: str) -> None:
        if self.lost:
            raise LockLost(f"session lost: {self.lost_reason}")
        try:
            async with self._io:
                await self.conn.execute(sql)
        except BaseException as exc:
            if _errmap.session_gone(exc):
                self.mark_lost(f"{type(exc).__name__}: {exc}")
            raise

    def start_probe(self) -> None:
        if self._probe is None and not self.lost:
            self._probe = asyncio.create_task(self._probe_loop(), name="pgcoord-holder-probe")

    async def _probe_loop(self) -> None:
        interval = self.holder.keepalive / 2
        while not self.lost:
            await asyncio.sleep(interval)
            probe = asyncio.ensure_future(self.fetchval(query("holder_probe")))
            probe.add_done_callback(consume_result)
            done, _ = await asyncio.wait({probe}, timeout=interval)
            if not done:
                probe.cancel()
                self.mark_lost(f"no answer to a probe within {interval:.1f}s")
            elif probe.exception() is not None and not self.lost:
                self.mark_lost(f"probe failed: {probe.exception()!r}")

    def mark_lost(self, reason: str) -> None:
        """The session is gone: cancel every body holding a lock on it."""
        if self.lost:
            return
        self.lost_reason = reason
        log.warning("pgcoord LockHolder session (pid %s) lost: %s; %d lock(s) lost",
                    self.conn.backend_pid, reason, len(self.holding))
        for held, task in list(self.holding.items()):
            held.lost_reason = reason
            task.cancel(f"pgcoord: lock {held.request.describe()} lost: {reason}")
        if self._probe is not None and self._probe is not asyncio.current_task():
            self._probe.cancel()
        # Close our end too, so a half-open socket cannot linger.
        self.holder._track(asyncio.ensure_future(self.conn.close_now()))

    async def stop_probe(self) -> None:
        probe, self._probe = self._probe, None
        if probe is not None and probe is not asyncio.current_task():
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await probe

    async def retire(self) -> None:
        """Give the connection back holding none of our locks, or close it."""
        await self.stop_probe()
        if self.lost:
            with contextlib.suppress(Exception):
                await self.conn.close_now()
            return
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT), self._io:
                await self.conn.fetchval(query("holder_unlock_all"))
                left = await self.conn.fetchval(query("holder_advisory_count"))
                if left != 0:
                    raise RuntimeError(f"{left} advisory lock(s) still held after unlock_all")
                await self.conn.execute(query("holder_reset"))
        except BaseException as exc:
            log.warning("closing LockHolder connection instead of returning it: %r", exc)
            with contextlib.suppress(Exception):
                await self.conn.close_now()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        await self.conn.give_back()


_CALLS = {
    (kind, shared): query("advisory_call").format(fn=fn + ("_shared" if shared else ""))
    for kind, fn in (("try", "pg_try_advisory_lock"), ("unlock", "pg_advisory_unlock"))
    for shared in (False, True)
}



class LockHolder:
    """Session advisory locks held on dedicated connections; see DESIGN §2.

    ``LockHolder(dsn)`` owns its connections; ``LockHolder(pool)`` borrows them
    from an asyncpg ``Pool``, a psycopg ``AsyncConnectionPool`` or a SQLAlchemy
    ``AsyncEngine`` and returns them clean. Use as ``async with``.
    """

    def __init__(
        self, source: Any, *, driver: str | None = None, application_name: str = "pgcoord-holder",
        keepalive: float = 5.0,
    ) -> None:
        if isinstance(keepalive, bool) or not isinstance(keepalive, int | float) or not keepalive > 0:
            raise ValueError(f"keepalive must be a positive number of seconds, got {keepalive!r}")
        if not isinstance(application_name, str):
            raise TypeError("application_name must be a str")
        self.keepalive = float(keepalive)
        self.application_name = application_name
        self._source: ConnectionSource = connection_source(source, driver, self.keepalive)
        self._main: _Carrier | None = None
        self._main_lock = asyncio.Lock()
        self._carriers: set[_Carrier] = set()
        self._queues: dict[int, tuple[asyncio.Lock, int]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self._open = False

    # -- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> LockHolder:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Connect the main session now (``lock()`` would otherwise do it)."""
        self._open = True
        await self._main_carrier()

    async def close(self) -> None:
        """Release every lock and give every connection back. Safe to call twice."""
        self._open = False
        carriers, self._carriers, self._main = list(self._carriers), set(), None
        for carrier in carriers:
            await finish_despite_cancel(carrier.retire())
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(consume_result)

    @property
    def backend_pid(self) -> int | None:
        """The main session's server pid (for tests and operators)."""
        return None if self._main is None or self._main.lost else self._main.conn.backend_pid

    # -- connections -------------------------------------------------------------

    async def _connect(self, *, dedicated: bool) -> _Carrier:
        conn = await self._source.open()
        try:
            await conn.prepare()
            idle = str(max(1, int(self.keepalive / 2)))
            pid = await conn.fetchval(
                query("holder_setup"), self.application_name, idle, idle,
                str(int(self.keepalive * 1000)),
            )
            conn.backend_pid = int(pid)
            if not dedicated:
                await self._refuse_transaction_pooler(conn)
        except BaseException:
            await finish_despite_cancel(conn.close_now())
            raise
        carrier = _Carrier(conn, self, dedicated=dedicated)
        self._carriers.add(carrier)
        return carrier

    async def _refuse_transaction_pooler(self, conn: HolderConnection) -> None:
        if await behind_transaction_pooler(self._source, conn):
            raise UnsupportedConnection(
                "LockHolder needs a session of its own, but this connection goes through a "
                "transaction-mode pooler (the server session changed between statements). "
                "Connect directly or through a session-mode pool."
            )

    async def _main_carrier(self) -> _Carrier:
        if not self._open:
            raise RuntimeError("LockHolder is closed: use `async with LockHolder(...)` or open()")
        async with self._main_lock:
            if self._main is None or self._main.lost:
                if self._main is not None:
                    self._carriers.discard(self._main)
                self._main = await self._connect(dedicated=False)
                self._main.start_probe()
            return self._main

    async def _retire(self, carrier: _Carrier) -> None:
        self._carriers.discard(carrier)
        await finish_despite_cancel(carrier.retire())

    # -- local FIFO per key -------------------------------------------------------

    def _queue(self, key: int) -> asyncio.Lock:
        lock, users = self._queues.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._queues[key] = (lock, users + 1)
        return lock

    def _unqueue(self, key: int) -> None:
        lock, users = self._queues[key]
        if users <= 1:
            del self._queues[key]
        else:
            self._queues[key] = (lock, users - 1)

    # -- the API -------------------------------------------------------------------

    def lock(
        self, key: LockKeyLike, *, wait: bool = True, timeout: float | None = None,
        shared: bool = False,
    ) -> HeldLock:
        """A session lock on ``key``; ``async with`` it. Options as in ``exclusive()``."""
        return HeldLock(self, LockRequest(key, wait=wait, timeout=timeout, shared=shared,
                                          scope="session"))


class HeldLock:
    """One session lock held through a :class:`LockHolder`. Single use."""

    def __init__(self, holder: LockHolder, request: LockRequest) -> None:
        self.holder = holder
        self.request = request
        self.carrier: _Carrier | None = None
        self.lost_reason: str | None = None
        self._queued = False

    @property
    def _fn(self) -> str:
        return "pg_advisory_lock_shared" if self.request.shared else "pg_advisory_lock"

    def _call(self, kind: str) -> str:
        """``SELECT pg_try_advisory_lock($1)`` and friends, for this lock's mode."""
        return _CALLS[(kind, self.request.shared)]

    async def __aenter__(self) -> HeldLock:
        if self._queued:
            raise RuntimeError("this HeldLock is already in use; call holder.lock() again")
        holder, request = self.holder, self.request
        started = time.monotonic()
        deadline = None if request.timeout is None else started + request.timeout
        queue = holder._queue(request.key)
        self._queued = True
        try:
            await self._wait_local(queue, deadline)
            try:
                self.carrier = await self._take(deadline)
            except BaseException:
                queue.release()
                raise
        except BaseException:
            self._queued = False
            holder._unqueue(request.key)
            raise
        self.carrier.holding[self] = asyncio.current_task()  # type: ignore[assignment]
        metrics.lock_wait(self.request.metric_name, time.monotonic() - started)
        if self.carrier.dedicated:
            self.carrier.start_probe()
        return self

    async def _wait_local(self, queue: asyncio.Lock, deadline: float | None) -> None:
        """Queue behind this process's other holders of the key (FIFO)."""
        if not self.request.wait:
            if queue.locked():
                metrics.busy(self.request.metric_name)
                raise LockBusy(f"lock {self.request.describe()} is held in this process")
            await queue.acquire()
            return
        if deadline is None:
            await queue.acquire()
            return
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await queue.acquire()
        except TimeoutError:
            raise LockTimeout(
                f"lock {self.request.describe()} not granted within {self.request.timeout}s "
                "(held in this process)"
            ) from None

    async def _take(self, deadline: float | None) -> _Carrier:
        holder, request = self.holder, self.request
        main = await holder._main_carrier()
        try:
            got = await main.fetchval(self._call("try"), request.key)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and not main.lost:
                # The try may have been granted just before the cancel landed.
                await finish_despite_cancel(self._undo(main))
            request.raise_translated(exc)
        if got:
            return main
        if not request.wait or request.timeout == 0:
            metrics.busy(request.metric_name)
            raise (LockTimeout if request.timeout == 0 else LockBusy)(
                f"lock {request.describe()} is held by another session"
            )
        # Wait on a connection of its own so the main one stays free.
        carrier = await holder._connect(dedicated=True)
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        waiting = LockRequest(request.key, wait=True, timeout=remaining, shared=request.shared,
                              scope="session")
        try:
            await carrier.execute(waiting.statement.inline)
        except BaseException as exc:
            # Whatever happened — timeout, deadlock, a cancel racing the grant —
            # the dedicated connection is verified clean or closed.
            await holder._retire(carrier)
            if isinstance(exc, PgcoordError | asyncio.CancelledError):
                raise
            mapped = request.translate(exc)
            if isinstance(mapped, LockTimeout):
                raise LockTimeout(
                    f"lock {request.describe()} not granted within {request.timeout}s"
                ) from exc
            request.raise_translated(exc)
        return carrier

    async def _undo(self, carrier: _Carrier) -> None:
        mode = "ShareLock" if self.request.shared else "ExclusiveLock"
        unlock_fn = self._fn.replace("_lock", "_unlock", 1)
        with contextlib.suppress(Exception):
            await carrier.execute(
                query("holder_undo").format(key=self.request.key, mode=mode, unlock_fn=unlock_fn)
            )

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        carrier, holder, request = self.carrier, self.holder, self.request
        assert carrier is not None
        carrier.holding.pop(self, None)
        self.carrier = None
        try:
            if self.lost_reason is not None:
                metrics.lock_lost(request.metric_name, self.lost_reason)
                if isinstance(exc, asyncio.CancelledError):
                    absorb_cancel()
                raise LockLost(f"lock {request.describe()} lost: {self.lost_reason}") from exc
            if carrier.dedicated:
                await holder._retire(carrier)
            elif not carrier.lost:
                try:
                    await finish_despite_cancel(carrier.fetchval(self._call("unlock"), request.key))
                except LockLost:
                    pass  # the session ended with the body done: the server released it
                except Exception as unlock_error:
                    if not carrier.lost:
                        raise
                    log.debug("unlock on a lost session: %r", unlock_error)
        finally:
            self._queued = False
            holder._queues[request.key][0].release()
            holder._unqueue(request.key)
