"""``LockHolder``: session advisory locks on dedicated connections.

Session locks outlive transactions, so long work need not hold one open. They
also outlive the code that took them, which is why every pool makes them
dangerous (asyncpg's unlocks all on release, psycopg's and SQLAlchemy's leak
them to the next user). A ``LockHolder`` therefore takes them only on
connections it owns or has borrowed for its lifetime, and gives a borrowed one
back only after ``pg_locks`` shows it holds nothing, with the settings it
changed put back.

Layout: one *main* connection carries every lock that is free when asked for
(``pg_try_advisory_lock``), so it is never blocked and stays free for unlocks and
liveness probes. A lock that must be waited for is waited for on a *waiting
connection* of its own, which then carries that one lock until it is released.
Waiting connections are bounded per holder (``max_wait_connections``): from a
DSN they are opened; from a pool they are borrowed only when the pool can lend
one at once (so a holder never waits on its own pool), else ``PoolExhausted``.
Each connection is probed every ``keepalive / 2`` seconds, and the driver tells
at once when the server closes it; when one is lost, every body holding a lock
on it is cancelled and its ``async with`` raises ``LockLost``.

Unlocks on the main connection are not waited for. Leaving the ``async with``
queues the unlock; it rides in the same round trip as the next statement on
that connection (the next lock's try runs right after it, in one statement),
or, when nothing else comes first, is sent on the event loop's next turn. An
unlock that fails ends the session, which releases every lock on it (bodies
still holding one get ``LockLost``), so a lock is never left held by mistake.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .._core import errmap as _errmap
from .._core.aio import (
    CLEANUP_TIMEOUT,
    CleanupTimeout,
    Supervisor,
    absorb_cancel,
    finish_despite_cancel,
)
from .._core.checks import KEEPALIVE_MAX
from .._core.queries import query
from .._drivers.capacity import pool_capacity
from .._drivers.dedicated import (
    ConnectionSource,
    HolderConnection,
    behind_transaction_pooler,
    connection_source,
)
from ..errors import (
    LockBusy,
    LockLost,
    LockTimeout,
    PgcoordError,
    PoolExhausted,
    UnsupportedConnection,
)
from ..keys import LockKeyLike
from ..locks.advisory import LockRequest, not_granted, recorded_names
from ..observability import metrics
from .carrier import Carrier

if TYPE_CHECKING:
    from ..member import Member
    from .semaphore import HeldSemaphore

__all__ = ["HeldLock", "LockHolder"]

log = logging.getLogger("pgcoord.session")

T = TypeVar("T")

#: How long close() gives the main session to cancel its waiting sessions' lock waits.
CANCEL_WAITS_BOUND = 1.0


@functools.lru_cache(maxsize=4096, typed=True)
def _request(key: LockKeyLike, wait: bool, timeout: float | None, shared: bool) -> LockRequest:
    """Requests are immutable and services reuse their keys: validate each once."""
    return LockRequest(key, wait=wait, timeout=timeout, shared=shared, scope="session")



def _try_lock_with(request: Any) -> Callable[[Carrier], Awaitable[bool]]:
    async def attempt(main: Carrier) -> bool:
        if request.name is not None and request.key not in recorded_names:
            await _record_name(main, request)
        return bool(await main.try_lock(request))

    return attempt


async def _record_name(main: Carrier, request: LockRequest) -> None:
    """Name the key in pgcoord.lock_names before its first try in this process, so
    that pgcoord.holders names the lock from its first grant. A statement of its own
    (autocommit): never part of the lock's fate, and best effort: a missing schema,
    a missing grant or a busy row leave the lock unnamed, never refused. Tried once
    per key and process."""
    try:
        await main.call(query("lock_names_record_row"), request.key, request.name)
    except Exception as exc:
        if main.lost:
            raise  # the session is gone: the caller tries the lock on a new one
        log.debug("lock name %r not recorded: %s", request.name, exc)
    recorded_names.add(request.key)


class LockHolder:
    """Session advisory locks held on dedicated connections; see docs/lockholder.md.

    ``LockHolder(dsn)`` owns its connections; ``LockHolder(pool)`` borrows them
    from an asyncpg ``Pool``, a psycopg ``AsyncConnectionPool`` or a SQLAlchemy
    ``AsyncEngine`` and returns them clean, with the settings it changed put
    back. Use as ``async with``.

    Connections: one *main* connection for the holder's lifetime (from a pool,
    borrowed as any borrower would, waiting for the pool if it must; a pool
    timeout raises ``PoolExhausted``), plus one per lock that had to wait, for
    as long as that lock is held: at most ``max_wait_connections`` of those at
    once. From a DSN they are opened; from a pool or engine they are borrowed
    only when the pool can lend one at once (one idle, or room to open one).
    A lock that must wait and cannot get one raises ``PoolExhausted`` at once:
    it never waits out the pool's timeout. A pool of ``max_size=1`` works for
    every lock that is free when asked for (and ``wait=False``).

    Unlocks: leaving a lock on the main connection does not wait for the server
    (``defer_unlocks=True``): the unlock rides with the next statement on that
    connection (the next lock's try, in the same round trip), or is sent on the
    event loop's next turn. A session waiting for the lock in the server is
    granted it then. Code that must know the lock is free on the server before
    it goes on (it tells another process by other means, or blocks the event
    loop next) awaits ``holder.flush()``, or uses ``defer_unlocks=False``, with
    which leaving a lock waits for the unlock's reply. Either way an unlock that
    fails ends the session, which releases every lock on it.

    ``keepalive`` bounds how long a lost session goes unnoticed (probes every
    ``keepalive/2``, TCP keepalive and ``tcp_user_timeout`` on the session), and
    how long a give-back or an unlock may take (at most 5 s) before the
    connection is closed instead.
    """

    def __init__(
        self, source: Any, *, driver: str | None = None, application_name: str = "pgcoord-holder",
        keepalive: float = 5.0, max_wait_connections: int = 8, defer_unlocks: bool = True,
    ) -> None:
        if (isinstance(keepalive, bool) or not isinstance(keepalive, int | float)
                or not 0 < keepalive <= KEEPALIVE_MAX):
            raise ValueError(f"keepalive must be a number of seconds > 0 and <= {KEEPALIVE_MAX:.0f} "
                             f"(it sets the session's tcp_user_timeout), got {keepalive!r}")
        if not isinstance(application_name, str):
            raise TypeError("application_name must be a str")
        if (isinstance(max_wait_connections, bool) or not isinstance(max_wait_connections, int)
                or max_wait_connections < 0):
            raise ValueError(
                f"max_wait_connections must be an int >= 0, got {max_wait_connections!r}")
        self.keepalive = float(keepalive)
        self.application_name = application_name
        self.max_wait_connections = max_wait_connections
        self.defer_unlocks = bool(defer_unlocks)
        self._cleanup_bound = min(CLEANUP_TIMEOUT, max(1.0, self.keepalive))
        from ..member import Member

        # Given a Member, the main connection is the member's session (locks that
        # are free when asked for cost no connection at all); locks that must wait
        # open connections of their own from the member's DSN, as from a DSN.
        self._member: Member | None = source if isinstance(source, Member) else None
        if self._member is not None:
            if driver is not None:
                raise ValueError("driver= belongs to the Member, not its LockHolder")
            self._source: ConnectionSource = self._member._source
        else:
            self._source = connection_source(source, driver, self.keepalive)
        #: How many connections a pool may lend us that its server ended while idle.
        self._lend_tries = 1 if isinstance(source, str | Member) else \
            min(max(2, (pool_capacity(source) or 1) + 1), 12)
        self._main: Carrier | None = None
        self._main_lock = asyncio.Lock()
        self._carriers: set[Carrier] = set()
        self._waiting_conns = 0
        # Local FIFO per key: present while a task of this process has the key;
        # the deque holds the futures of tasks queued behind it. Holders on one
        # member share its session, where locks are re-entrant: they share one FIFO.
        self._local: dict[int, collections.deque[asyncio.Future[None]] | None] = (
            {} if self._member is None else self._member.holder_queues)
        self._tasks = Supervisor("lock holder", log)  # deferred unlocks, discards
        self._open = False
        self._closing_task: asyncio.Task[Any] | None = None

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
        """Release every lock and give every connection back. Safe to call twice.

        Each give-back is bounded (``min(5 s, keepalive)``); one that runs past it
        closes its connection instead, and close() returns all the same. A
        cancellation of the caller is delivered once the close is over: a close
        cut short would leave the sessions (kept alive by their probes) and their
        locks behind."""
        self._open = False
        self._closing_task = asyncio.current_task()
        await finish_despite_cancel(self._close(), bound=None)

    async def _close(self) -> None:
        carriers, self._main = list(self._carriers), None
        # A body still inside `async with holder.lock(...)` is about to lose its lock
        # with the give-back: it is told (cancelled, then LockLost), never left to run
        # its critical section unlocked.
        for carrier in carriers:
            for held, body in list(carrier.holding.items()):
                if held.lost_reason is None and body is not self._closing_task:
                    held.lost_reason = "the LockHolder was closed while the lock was held"
                    body.cancel(f"pgcoord: lock {held.request.describe()} lost: {held.lost_reason}")
        waiting = [c for c in carriers if c.dedicated and not c.holding and not c.lost]
        main = next((c for c in carriers if not c.dedicated and not c.lost and not c.retired), None)
        if waiting and main is not None:
            # A backend waiting for a lock sees its closed socket only at its next
            # client check (client_connection_check_interval, a second), and stays in
            # the lock's queue until then (granted the lock, it holds it a moment):
            # cut the waits short from the main session first.
            try:
                await finish_despite_cancel(
                    main.call(query("holder_cancel_waits"), [c.conn.backend_pid for c in waiting]),
                    bound=min(CANCEL_WAITS_BOUND, self._cleanup_bound), on_timeout=main.overran)
            except CleanupTimeout:
                # Only a speed-up (the server's client check ends the waits within a
                # second anyway); a session that does not answer is as good as gone,
                # and its give-back would wait a whole bound again.
                main.mark_lost(f"no answer to cancelling the lock waits within "
                               f"{min(CANCEL_WAITS_BOUND, self._cleanup_bound):.1f}s")
            except Exception:
                pass
        for carrier in carriers:
            if carrier.dedicated and not carrier.holding:
                # Still waiting for its lock: no one will hold it now.
                carrier.mark_lost("the LockHolder was closed")
            else:
                await self._retire(carrier)
        tasks = self._tasks.pending()
        if tasks:
            try:
                await finish_despite_cancel(asyncio.wait(tasks), bound=self._cleanup_bound)
            except CleanupTimeout:
                for task in tasks:
                    task.cancel()

    async def flush(self) -> None:
        """Wait until every lock left so far is released on the server.

        Leaving ``async with holder.lock(...)`` does not wait for the server: the
        unlock rides with the holder's next statement, or is sent on the event
        loop's next turn. A session waiting for the lock in the server is granted
        it then either way; await this first when you are about to tell someone
        else, by other means, that the lock is free."""
        main = self._main
        if main is not None and not main.lost and not main.retired:
            async with main._io:
                await main._send_unlocks()

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._tasks.adopt(task, collected=True)

    @property
    def backend_pid(self) -> int | None:
        """The main session's server pid (for tests and operators)."""
        return None if self._main is None or self._main.lost else self._main.conn.backend_pid

    # -- connections -------------------------------------------------------------

    async def _setup(self, conn: HolderConnection, *, dedicated: bool) -> Carrier:
        try:
            await conn.prepare()
            idle = str(max(1, int(self.keepalive / 2)))
            row = await conn.fetchrow(
                query("holder_setup_saving"), self.application_name, idle, idle,
                str(int(self.keepalive * 1000)), str(int(min(1.0, self.keepalive / 2) * 1000)))
            assert row is not None
            conn.backend_pid = int(row[0])
            saved = (list(row[1]), list(row[2]))
            if row[4]:
                # Granted there, a session lock would exclude only the standby's sessions.
                raise PgcoordError(_errmap.STANDBY_MESSAGE)
            if not dedicated:
                await self._refuse_transaction_pooler(conn)
        except BaseException:
            with contextlib.suppress(CleanupTimeout):
                await finish_despite_cancel(conn.close_now(), bound=self._cleanup_bound,
                                            on_timeout=conn.terminate)
            raise
        carrier = Carrier(conn, self, dedicated=dedicated, saved=saved)
        self._carriers.add(carrier)
        return carrier

    async def _set_up_borrowed(self, borrow: Callable[[], Awaitable[HolderConnection]], *,
                               dedicated: bool) -> Carrier:
        """``_setup`` on a connection from ``borrow()``. A pool may lend a connection the
        server has ended (its idle_session_timeout, an operator) while it sat idle: the
        setup took nothing on it, so it is given back (the pool discards it) and another
        borrowed, once per connection the pool may hold."""
        tries = self._lend_tries
        for n in range(tries):
            conn = await borrow()
            try:
                return await self._setup(conn, dedicated=dedicated)
            except Exception as exc:
                if not _errmap.session_gone(exc) or n + 1 == tries:
                    raise
        raise AssertionError("unreachable")

    async def _refuse_transaction_pooler(self, conn: HolderConnection) -> None:
        if await behind_transaction_pooler(self._source, conn):
            raise UnsupportedConnection(
                "LockHolder needs a session of its own, but this connection goes through a "
                "transaction-mode pooler (the server session changed between statements). "
                "Connect directly or through a session-mode pool."
            )

    async def _on_main(self, what: str, request: Any,
                       attempt: Callable[[Carrier], Awaitable[T]]) -> tuple[Carrier, T]:
        """``attempt(main)`` on the main session; once more on a new session when the
        session died under it (the try then holds nothing). A driver error of a live
        session is the request's to translate."""
        for tries in (1, 2):
            main = self._main
            if main is None or main.lost or not self._open:
                main = await self._main_carrier()
            try:
                return main, await attempt(main)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not main.lost:
                    if isinstance(exc, PgcoordError):
                        raise
                    request.raise_translated(exc)
                if tries == 2:
                    raise LockLost(f"the LockHolder's session was lost while taking {what}: "
                                   f"{main.lost_reason}") from exc
        raise AssertionError("unreachable")

    async def _main_carrier(self) -> Carrier:
        if not self._open:
            raise RuntimeError("LockHolder is closed: use `async with LockHolder(...)` or open()")
        async with self._main_lock:
            main = self._main
            if main is None or main.lost:
                if self._member is not None:
                    main = self._main = await self._on_member(self._member)
                else:
                    main = self._main = await self._set_up_borrowed(self._source.open, dedicated=False)
                    main.start_probe()
            return main

    async def _on_member(self, member: Member) -> Carrier:
        """The member's session as our main connection: no settings of ours on it
        (it is shared), no probe (the member heartbeats and hears its loss)."""
        await member.wait_joined()
        if member.polling:
            raise UnsupportedConnection(
                "LockHolder needs a session, but this member goes through a transaction-mode "
                "pooler (it has none)")
        carrier = Carrier(member.session(), self, dedicated=False, saved=([], []), shared=True)
        self._carriers.add(carrier)
        return carrier

    async def _waiting_carrier(self, request: LockRequest) -> Carrier:
        """A connection of its own for a lock that must wait, if one can be had at once."""
        if self._waiting_conns >= self.max_wait_connections:
            raise PoolExhausted(
                f"lock {request.describe()} is held by another session and must be waited for "
                f"on a connection of its own, but this LockHolder already uses "
                f"{self._waiting_conns} (max_wait_connections={self.max_wait_connections}); "
                "release a lock that waited, raise max_wait_connections, or use wait=False"
            )
        self._waiting_conns += 1
        try:
            async def lend() -> HolderConnection:
                conn = await self._source.open_now()
                if conn is None:
                    raise PoolExhausted(
                        f"lock {request.describe()} is held by another session and must be waited "
                        "for on a connection of its own, but the pool has none to lend at once (a "
                        "LockHolder never waits on its own pool); give the pool room for the locks "
                        "that wait, pass a DSN, or use wait=False"
                    )
                return conn

            carrier = await self._set_up_borrowed(lend, dedicated=True)
        except BaseException:
            self._waiting_conns -= 1
            raise
        return carrier

    def _drop(self, carrier: Carrier) -> None:
        """Forget a connection (retired or lost); once per connection."""
        if carrier in self._carriers:
            self._carriers.discard(carrier)
            if carrier.dedicated:
                self._waiting_conns -= 1

    async def _unlock_now(self, carrier: Carrier, request: LockRequest) -> None:
        try:
            await finish_despite_cancel(carrier.unlock_now(request.key, request.shared),
                                        bound=self._cleanup_bound, on_timeout=carrier.overran)
        except CleanupTimeout:
            carrier.mark_lost(f"the unlock of lock {request.describe()} got no answer within "
                              f"{self._cleanup_bound:.1f}s")

    async def _retire(self, carrier: Carrier) -> None:
        self._drop(carrier)
        try:
            await finish_despite_cancel(carrier.retire(), bound=self._cleanup_bound,
                                        on_timeout=carrier.overran)
        except CleanupTimeout:
            log.warning("pgcoord LockHolder: giving a connection back took over %.1fs; "
                        "closed it instead", self._cleanup_bound)

    # -- local FIFO per key -------------------------------------------------------

    async def _wait_local(self, request: LockRequest, deadline: float | None) -> None:
        """Queue behind this process's other holders of the key (FIFO)."""
        key = request.key
        queue = self._local.get(key)
        if not request.wait:
            metrics.busy(request.metric_name)
            raise LockBusy(f"lock {request.describe()} is held in this process")
        if queue is None:
            queue = self._local[key] = collections.deque()
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(turn)
        try:
            if deadline is None:
                await turn
            else:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await turn
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                self._release_local(key)  # our turn came just as we gave up: pass it on
            else:
                turn.cancel()
                queue.remove(turn)
            if isinstance(exc, TimeoutError):
                raise LockTimeout(
                    f"lock {request.describe()} not granted within {request.timeout}s "
                    "(held in this process)"
                ) from None
            raise

    def _release_local(self, key: int) -> None:
        queue = self._local.get(key)
        while queue:
            turn = queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        del self._local[key]

    # -- the API -------------------------------------------------------------------

    def lock(
        self, key: LockKeyLike, *, wait: bool = True, timeout: float | None = None,
        shared: bool = False,
    ) -> HeldLock:
        """A session lock on ``key``; ``async with`` it. Options as in ``exclusive()``."""
        try:
            request = _request(key, wait, timeout, shared)
        except TypeError:  # unhashable: build it uncached, which raises the precise error
            request = LockRequest(key, wait=wait, timeout=timeout, shared=shared, scope="session")
        return HeldLock(self, request)


    def semaphore(
        self, name: str, *, limit: int, wait: bool = True, timeout: float | None = None,
    ) -> HeldSemaphore:
        """One of ``limit`` slots of semaphore ``name`` held by this session;
        ``async with`` it. Options and errors as in ``pgcoord.semaphore()``; a lost
        session cancels the body and raises ``LockLost``, as for ``lock()``."""
        from ..locks.semaphores import SemaphoreRequest
        from .semaphore import HeldSemaphore

        return HeldSemaphore(self, SemaphoreRequest(name, limit=limit, wait=wait, timeout=timeout))


class HeldLock:
    """One session lock held through a :class:`LockHolder`. Single use at a time."""

    __slots__ = ("_entered", "carrier", "holder", "lost_in_own_task", "lost_reason", "request")

    def __init__(self, holder: LockHolder, request: LockRequest) -> None:
        self.holder = holder
        self.request = request
        self.carrier: Carrier | None = None
        self.lost_reason: str | None = None
        # Lost (and so cancelled) from the body's own task: that cancellation is
        # pending until the body next awaits, so it is withdrawn only if it arrived.
        self.lost_in_own_task = False
        self._entered = False

    async def __aenter__(self) -> HeldLock:
        if self._entered:
            raise RuntimeError("this HeldLock is already in use; call holder.lock() again")
        holder, request = self.holder, self.request
        started = time.monotonic()
        deadline = None if request.timeout is None else started + request.timeout
        key = request.key
        self._entered = True
        try:
            if key in holder._local:
                await holder._wait_local(request, deadline)
            else:
                holder._local[key] = None
        except BaseException:
            self._entered = False
            raise
        try:
            carrier = await self._take(deadline)
        except BaseException:
            self._entered = False
            holder._release_local(key)
            raise
        if carrier.lost or carrier.retired:
            # Granted as the holder closed and gave the session up: not held now.
            self._entered = False
            holder._release_local(key)
            raise LockLost(f"lock {request.describe()} lost: "
                           f"{carrier.lost_reason or 'the LockHolder was closed'}")
        self.carrier = carrier
        self.lost_reason, self.lost_in_own_task = None, False
        carrier.holding[self] = asyncio.current_task()  # type: ignore[assignment]
        metrics.lock_wait(request.metric_name, time.monotonic() - started)
        if carrier.dedicated:
            carrier.start_probe()
        return self

    async def _take(self, deadline: float | None) -> Carrier:
        holder, request = self.holder, self.request
        main, got = await holder._on_main(f"lock {request.describe()}", request, _try_lock_with(request))
        if got:
            return main
        if not request.wait or request.timeout == 0:
            metrics.busy(request.metric_name)
            raise (LockTimeout if request.timeout == 0 else LockBusy)(
                f"lock {request.describe()} is held by another session"
            )
        return await self._wait_elsewhere(deadline)

    async def _wait_elsewhere(self, deadline: float | None) -> Carrier:
        """Wait on a connection of its own, so the main one stays free."""
        holder, request = self.holder, self.request
        carrier = await holder._waiting_carrier(request)
        if not holder._open:
            # close() came while this session was being opened, and never saw it.
            await holder._retire(carrier)
            raise LockLost(f"the LockHolder was closed before lock {request.describe()} was waited for")
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        waiting = LockRequest(request.key, wait=True, timeout=remaining, shared=request.shared,
                              scope="session")
        try:
            await carrier.wait_lock(waiting.statement.bound)  # its session's own settings: holder_setup
        except BaseException as exc:
            # Whatever happened — timeout, deadlock, a cancel racing the grant —
            # the waiting connection is verified clean or closed.
            await holder._retire(carrier)
            if isinstance(exc, PgcoordError | asyncio.CancelledError):
                raise
            if carrier.lost or not holder._open:  # close() cuts the waits short
                raise LockLost(f"the session waiting for lock {request.describe()} was lost: "
                               f"{carrier.lost_reason or 'the LockHolder was closed'}") from exc
            mapped = request.translate(exc)
            if isinstance(mapped, LockTimeout):
                raise LockTimeout(f"lock {request.describe()} {not_granted(request.timeout)}") from exc
            request.raise_translated(exc)
        return carrier

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
                # Our cancellation of the body is withdrawn whatever came of it: also
                # when a driver turned it into an error, or the body caught it, so that
                # the task's cancelling() count is its own again.
                if isinstance(exc, asyncio.CancelledError) or not self.lost_in_own_task:
                    absorb_cancel()
                raise LockLost(f"lock {request.describe()} lost: {self.lost_reason}") from exc
            if carrier.dedicated:
                await holder._retire(carrier)
            elif carrier.lost:
                pass  # the server released it with the session
            elif holder.defer_unlocks:
                carrier.defer_unlock(request.key, request.shared)
            else:
                await holder._unlock_now(carrier, request)
        finally:
            self._entered = False
            holder._release_local(request.key)
