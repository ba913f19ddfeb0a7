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
from types import TracebackType
from typing import TYPE_CHECKING, Any

from . import _errmap, metrics
from ._aio import (
    CLEANUP_TIMEOUT,
    CleanupTimeout,
    absorb_cancel,
    consume_result,
    finish_despite_cancel,
)
from ._holderconn import (
    ConnectionSource,
    HolderConnection,
    behind_transaction_pooler,
    connection_source,
)
from ._keys import LockKeyLike
from ._queries import query
from .errors import LockBusy, LockLost, LockTimeout, PgcoordError, PoolExhausted, UnsupportedConnection
from .locks import LockRequest

if TYPE_CHECKING:
    from .member import Member

__all__ = ["HeldLock", "LockHolder"]

log = logging.getLogger("pgcoord.session")

_FN = {False: "pg_try_advisory_lock", True: "pg_try_advisory_lock_shared"}
_TRY = {shared: query("advisory_call").format(fn=fn) for shared, fn in _FN.items()}
_TRY_AFTER_UNLOCKS = {shared: query("holder_unlocks_then_try").format(fn=fn)
                      for shared, fn in _FN.items()}
_UNLOCK_FN = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}
_TRY_AFTER_UNLOCK = {
    (shared, unlock_shared): query("holder_unlock_then_try").format(
        fn=_FN[shared], unlock_fn=_UNLOCK_FN[unlock_shared])
    for shared in (False, True) for unlock_shared in (False, True)
}
_UNLOCKS = query("holder_unlocks")
_PROBE = query("holder_probe")
_GIVE_BACK = query("holder_give_back")

# SQLSTATE query_canceled: a statement stopped part way, its effects unknown.
_QUERY_CANCELED = "57014"


class _Carrier:
    """One connection and the locks it carries.

    Every statement runs under ``_io``, one at a time. The main connection also
    keeps the unlocks not yet sent (``_unlock_exclusive``/``_unlock_shared``):
    whoever takes ``_io`` next sends them first.
    """

    def __init__(
        self, conn: HolderConnection, holder: LockHolder, *, dedicated: bool,
        saved: tuple[list[str], list[str | None]], shared: bool = False,
    ) -> None:
        self.conn = conn
        self.holder = holder
        self.dedicated = dedicated
        #: A member's session, shared with other features: never unlock_all on it.
        self.shared = shared
        self.saved = saved  # settings to put back before the connection goes back
        self.lost_reason: str | None = None
        self.retired = False
        self.holding: dict[HeldLock, asyncio.Task[Any]] = {}
        self._io = asyncio.Lock()
        # Who runs the statement in flight under _io: "user", "probe", "cleanup".
        self._io_owner: str | None = None
        self._probe: asyncio.Task[None] | None = None
        self._unlock_exclusive: list[int] = []
        self._unlock_shared: list[int] = []
        self._flush_due = False
        self._discarded = False
        self._loop = asyncio.get_running_loop()
        conn.on_lost(lambda: self.mark_lost("the server closed the connection"))

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def _check_usable(self) -> None:
        if self.lost_reason is not None:
            raise LockLost(f"session lost: {self.lost_reason}")
        if self.retired:
            raise RuntimeError("LockHolder is closed: use `async with LockHolder(...)` or open()")

    # -- taking and releasing locks ---------------------------------------------------

    async def try_lock(self, request: LockRequest) -> bool:
        """``pg_try_advisory_lock`` on this connection, after the unlocks not yet sent."""
        self._check_usable()
        async with self._io:
            self._check_usable()
            self._io_owner = "user"
            excl, shared = self._unlock_exclusive, self._unlock_shared
            try:
                if excl or shared:
                    self._unlock_exclusive, self._unlock_shared = [], []
                    if len(excl) + len(shared) == 1:
                        sql = _TRY_AFTER_UNLOCK[(request.shared, not excl)]
                        row = await self.conn.fetchrow(sql, request.key, (excl or shared)[0])
                    else:
                        row = await self.conn.fetchrow(
                            _TRY_AFTER_UNLOCKS[request.shared], request.key, excl, shared)
                    assert row is not None
                    if row[1]:
                        self._unlocks_missed(int(row[1]))
                        self._check_usable()  # the session was just ended
                    return bool(row[0])
                return bool(await self.conn.fetchval(_TRY[request.shared], request.key))
            except BaseException as exc:
                await self._after_failure(exc, excl, shared, request)
                raise

    async def wait_lock(self, statement: str) -> None:
        """A blocking lock statement (a waiting connection's one lock)."""
        self._check_usable()
        async with self._io:
            self._io_owner = "user"
            try:
                await self.conn.execute_blocking(statement)
            except BaseException as exc:
                if not self.lost and _errmap.session_gone(exc):
                    self.mark_lost(f"{type(exc).__name__}: {exc}")
                raise

    def defer_unlock(self, key: int, shared: bool) -> None:
        """Queue an unlock; it is sent with the next statement, or on the next loop turn."""
        (self._unlock_shared if shared else self._unlock_exclusive).append(key)
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush_soon)

    async def unlock_now(self, key: int, shared: bool) -> None:
        """Unlock (after any queued unlocks) and wait for the server's reply. A
        cleanup: run under ``finish_despite_cancel`` with ``on_timeout=overran``.
        A failure ends the session (see ``_send_unlocks``), so it is not raised."""
        async with self._io:
            if self.lost or self.retired:
                return
            self._io_owner = "cleanup"
            (self._unlock_shared if shared else self._unlock_exclusive).append(key)
            with contextlib.suppress(Exception):
                await self._send_unlocks()

    def _flush_soon(self) -> None:
        self._flush_due = False
        if (self._unlock_exclusive or self._unlock_shared) and not self.lost and not self.retired:
            self.holder._track(asyncio.ensure_future(self._flush()))

    async def _flush(self) -> None:
        async with self._io:
            self._io_owner = "user"
            await self._send_unlocks()

    async def _send_unlocks(self) -> bool:
        """Send the queued unlocks (``_io`` held); whether there were any."""
        excl, shared = self._unlock_exclusive, self._unlock_shared
        if not (excl or shared) or self.lost or self.retired:
            return False
        self._unlock_exclusive, self._unlock_shared = [], []
        try:
            missed = await self.conn.fetchval(_UNLOCKS, excl, shared)
        except BaseException as exc:
            await self._after_failure(exc, excl, shared, None)
            if not self.lost and not isinstance(exc, asyncio.CancelledError):
                # An unlock statement that the server refused leaves us unsure
                # what this session holds: end it, which releases everything.
                self.mark_lost(f"unlock failed: {exc!r}")
            raise
        if missed:
            self._unlocks_missed(missed)
        return True

    def _unlocks_missed(self, count: int) -> None:
        # An unlock that found nothing held means a lock this holder believed
        # held was not: the session is not what we think it is. End it.
        log.error("pgcoord LockHolder session (pid %s): %d unlock(s) found no lock held; "
                  "closing the session", self.conn.backend_pid, count)
        self.mark_lost(f"{count} unlock(s) found no lock held")

    async def _after_failure(
        self, exc: BaseException, excl: list[int], shared: list[int], request: LockRequest | None,
    ) -> None:
        """A statement that sent unlocks and/or a try failed: make sure the session
        holds none of those keys, or end it. ``_io`` is held."""
        if self.lost:
            return
        if _errmap.session_gone(exc):
            self.mark_lost(f"{type(exc).__name__}: {exc}")
            return
        code = _errmap.sqlstate(exc)
        if code is not None and code != _QUERY_CANCELED:
            # The server ran the statement and raised: the unlocks (evaluated
            # first) took effect, the try did not.
            return
        # Cancelled in flight: the server may or may not have run it, or the
        # try may have been granted just before the cancel landed.
        keys = [(k, False) for k in excl] + [(k, True) for k in shared]
        if request is not None:
            keys.append((request.key, request.shared))
        owner, self._io_owner = self._io_owner, "cleanup"
        try:
            await finish_despite_cancel(self._undo(keys), bound=self.holder._cleanup_bound,
                                        on_timeout=self.overran)
        except (CleanupTimeout, Exception) as undo_error:
            self.mark_lost(f"could not release locks after a cancelled statement: {undo_error!r}")
        finally:
            self._io_owner = owner

    async def _undo(self, keys: list[tuple[int, bool]]) -> None:
        """Release every level of each key this session holds (``_io`` held)."""
        statements = [
            query("holder_undo").format(
                key=key, mode="ShareLock" if shared else "ExclusiveLock",
                unlock_fn="pg_advisory_unlock_shared" if shared else "pg_advisory_unlock")
            for key, shared in keys
        ]
        if statements:
            await self.conn.execute(";\n".join(statements))

    # -- liveness -----------------------------------------------------------------------

    def start_probe(self) -> None:
        if self._probe is None and not self.lost:
            self._probe = asyncio.create_task(self._probe_loop(), name="pgcoord-holder-probe")

    async def _probe_once(self) -> None:
        async with self._io:
            if self.lost or self.retired:
                return
            self._io_owner = "probe"
            # Any round trip proves the session alive: queued unlocks serve.
            if not await self._send_unlocks():
                try:
                    await self.conn.fetchval(_PROBE)
                except BaseException as exc:
                    if not self.lost and _errmap.session_gone(exc):
                        self.mark_lost(f"probe failed: {exc!r}")
                    raise

    async def _probe_loop(self) -> None:
        interval = self.holder.keepalive / 2
        while not self.lost and not self.retired:
            await asyncio.sleep(interval)
            probe = asyncio.ensure_future(self._probe_once())
            probe.add_done_callback(consume_result)
            # asyncio.wait does not cancel the probe when this loop is cancelled
            # (retire): a probe in flight finishes, never leaving a cancelled
            # statement behind on a healthy connection.
            done, _ = await asyncio.wait({probe}, timeout=interval)
            if not done:
                probe.cancel()
                if self._io_owner == "probe":
                    self.conn.abort()  # its statement is being cancelled: close under it
                self.mark_lost(f"no answer to a probe within {interval:.1f}s")
            elif probe.exception() is not None and not self.lost:
                self.mark_lost(f"probe failed: {probe.exception()!r}")

    def mark_lost(self, reason: str) -> None:
        """The session is gone: cancel every body holding a lock on it, close it."""
        if self.lost_reason is not None:
            return
        self.lost_reason = reason
        if self.shared:
            # A member's session lives on after this carrier is given up (an unlock
            # refused, a bound overrun): nothing "ends the session" for us, so the
            # keys still held on it are unlocked when we let go (MemberSession).
            owned = getattr(self.conn, "owned", None)
            if owned is not None:
                for key in self._unlock_exclusive:
                    owned[(key, False)] += 1
                for key in self._unlock_shared:
                    owned[(key, True)] += 1
                for held in self.holding:
                    owned[(held.request.key, held.request.shared)] += 1
        self._unlock_exclusive, self._unlock_shared = [], []
        log.warning("pgcoord LockHolder session (pid %s) lost: %s; %d lock(s) lost",
                    self.conn.backend_pid, reason, len(self.holding))
        for held, task in list(self.holding.items()):
            held.lost_reason = reason
            task.cancel(f"pgcoord: lock {held.request.describe()} lost: {reason}")
        if self._probe is not None and self._probe is not asyncio.current_task():
            self._probe.cancel()
        self.holder._drop(self)
        # Close our end at once, so a half-open socket cannot linger and a
        # statement in flight fails now; then the pool gets its slot back.
        self.conn.terminate()
        self.holder._track(asyncio.ensure_future(self.discard()))

    def overran(self) -> None:
        """``on_timeout`` of a cleanup on this connection: close it now. When the
        cleanup's own statement is in flight (it is being cancelled) the socket is
        closed under it; when another one is, that one is woken by end of file."""
        if self._io_owner == "cleanup":
            self.conn.abort()
        else:
            self.conn.terminate()

    async def discard(self) -> None:
        """Close the connection and hand a borrowed one back as broken (once)."""
        if self._discarded:
            return
        self._discarded = True
        try:
            await finish_despite_cancel(self.conn.close_now(), bound=self.holder._cleanup_bound,
                                        on_timeout=self.conn.terminate)
        except CleanupTimeout:
            log.warning("pgcoord LockHolder: a closed connection's pool did not take it back "
                        "within %.1fs", self.holder._cleanup_bound)

    # -- giving back ------------------------------------------------------------------------

    async def retire(self) -> None:
        """Give the connection back holding none of our locks and with its settings
        put back, or discard it. Run under ``finish_despite_cancel`` with
        ``on_timeout=conn.terminate``: past the bound this is cancelled, and the
        connection discarded."""
        self.retired = True
        if self._probe is not None and self._probe is not asyncio.current_task():
            self._probe.cancel()
        if self.lost:
            return  # mark_lost discards it
        if self.shared:
            await self._let_go_of_shared()
            return
        try:
            async with self._io:
                self._io_owner = "cleanup"
                self._unlock_exclusive, self._unlock_shared = [], []
                row = await self.conn.fetchrow(_GIVE_BACK, *self.saved)
            assert row is not None
            if row[0] != 0:
                raise PgcoordError(f"{row[0]} advisory lock(s) still held after unlock_all")
            await self.conn.give_back()
            self._discarded = True
        except BaseException as exc:
            log.warning("pgcoord LockHolder: closing the connection instead of giving it back: %r",
                        exc)
            await self.discard()
            if isinstance(exc, asyncio.CancelledError):
                raise


    async def _let_go_of_shared(self) -> None:
        """Retire on a member's session: send the unlocks not yet sent and undo the
        locks still held by bodies, key by key; the session itself stays."""
        try:
            async with self._io:
                self._io_owner = "cleanup"
                await self._send_unlocks()
                keys = [(held.request.key, held.request.shared) for held in self.holding]
                await self._undo(keys)
        finally:
            self.conn.terminate()
            self._discarded = True


@functools.lru_cache(maxsize=4096, typed=True)
def _request(key: LockKeyLike, wait: bool, timeout: float | None, shared: bool) -> LockRequest:
    """Requests are immutable and services reuse their keys: validate each once."""
    return LockRequest(key, wait=wait, timeout=timeout, shared=shared, scope="session")


class LockHolder:
    """Session advisory locks held on dedicated connections; see DESIGN §2.

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
        if isinstance(keepalive, bool) or not isinstance(keepalive, int | float) or not keepalive > 0:
            raise ValueError(f"keepalive must be a positive number of seconds, got {keepalive!r}")
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
        from .member import Member

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
        self._main: _Carrier | None = None
        self._main_lock = asyncio.Lock()
        self._carriers: set[_Carrier] = set()
        self._waiting_conns = 0
        # Local FIFO per key: present while a task of this process has the key;
        # the deque holds the futures of tasks queued behind it. Holders on one
        # member share its session, where locks are re-entrant: they share one FIFO.
        self._local: dict[int, collections.deque[asyncio.Future[None]] | None] = (
            {} if self._member is None else self._member.holder_queues)
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
        """Release every lock and give every connection back. Safe to call twice.

        Each give-back is bounded (``min(5 s, keepalive)``); one that runs past it
        closes its connection instead, and close() returns all the same."""
        self._open = False
        carriers, self._main = list(self._carriers), None
        for carrier in carriers:
            if carrier.dedicated and not carrier.holding:
                # Still waiting for its lock: no one will hold it now.
                carrier.mark_lost("the LockHolder was closed")
            else:
                await self._retire(carrier)
        tasks = [t for t in self._tasks if not t.done()]
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
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(consume_result)

    @property
    def backend_pid(self) -> int | None:
        """The main session's server pid (for tests and operators)."""
        return None if self._main is None or self._main.lost else self._main.conn.backend_pid

    # -- connections -------------------------------------------------------------

    async def _setup(self, conn: HolderConnection, *, dedicated: bool) -> _Carrier:
        try:
            await conn.prepare()
            idle = str(max(1, int(self.keepalive / 2)))
            row = await conn.fetchrow(
                query("holder_setup_saving"), self.application_name, idle, idle,
                str(int(self.keepalive * 1000)), str(int(min(1.0, self.keepalive / 2) * 1000)))
            assert row is not None
            conn.backend_pid = int(row[0])
            saved = (list(row[1]), list(row[2]))
            if not dedicated:
                await self._refuse_transaction_pooler(conn)
        except BaseException:
            with contextlib.suppress(CleanupTimeout):
                await finish_despite_cancel(conn.close_now(), bound=self._cleanup_bound,
                                            on_timeout=conn.terminate)
            raise
        carrier = _Carrier(conn, self, dedicated=dedicated, saved=saved)
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
            main = self._main
            if main is None or main.lost:
                if self._member is not None:
                    main = self._main = await self._on_member(self._member)
                else:
                    main = self._main = await self._setup(await self._source.open(), dedicated=False)
                    main.start_probe()
            return main

    async def _on_member(self, member: Member) -> _Carrier:
        """The member's session as our main connection: no settings of ours on it
        (it is shared), no probe (the member heartbeats and hears its loss)."""
        await member.wait_joined()
        if member.polling:
            raise UnsupportedConnection(
                "LockHolder needs a session, but this member goes through a transaction-mode "
                "pooler (it has none)")
        carrier = _Carrier(member.session(), self, dedicated=False, saved=([], []), shared=True)
        self._carriers.add(carrier)
        return carrier

    async def _waiting_carrier(self, request: LockRequest) -> _Carrier:
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
            conn = await self._source.open_now()
            if conn is None:
                raise PoolExhausted(
                    f"lock {request.describe()} is held by another session and must be waited "
                    "for on a connection of its own, but the pool has none to lend at once (a "
                    "LockHolder never waits on its own pool); give the pool room for the locks "
                    "that wait, pass a DSN, or use wait=False"
                )
            carrier = await self._setup(conn, dedicated=True)
        except BaseException:
            self._waiting_conns -= 1
            raise
        return carrier

    def _drop(self, carrier: _Carrier) -> None:
        """Forget a connection (retired or lost); once per connection."""
        if carrier in self._carriers:
            self._carriers.discard(carrier)
            if carrier.dedicated:
                self._waiting_conns -= 1

    async def _unlock_now(self, carrier: _Carrier, request: LockRequest) -> None:
        try:
            await finish_despite_cancel(carrier.unlock_now(request.key, request.shared),
                                        bound=self._cleanup_bound, on_timeout=carrier.overran)
        except CleanupTimeout:
            carrier.mark_lost(f"the unlock of lock {request.describe()} got no answer within "
                              f"{self._cleanup_bound:.1f}s")

    async def _retire(self, carrier: _Carrier) -> None:
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


class HeldLock:
    """One session lock held through a :class:`LockHolder`. Single use at a time."""

    __slots__ = ("_entered", "carrier", "holder", "lost_reason", "request")

    def __init__(self, holder: LockHolder, request: LockRequest) -> None:
        self.holder = holder
        self.request = request
        self.carrier: _Carrier | None = None
        self.lost_reason: str | None = None
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
        self.carrier = carrier
        self.lost_reason = None
        carrier.holding[self] = asyncio.current_task()  # type: ignore[assignment]
        metrics.lock_wait(request.metric_name, time.monotonic() - started)
        if carrier.dedicated:
            carrier.start_probe()
        return self

    async def _take(self, deadline: float | None) -> _Carrier:
        holder, request = self.holder, self.request
        main: _Carrier | None = None
        got = False
        for attempt in (1, 2):
            main = holder._main
            if main is None or main.lost or not holder._open:
                main = await holder._main_carrier()
            try:
                got = await main.try_lock(request)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not main.lost:
                    if isinstance(exc, PgcoordError):
                        raise
                    request.raise_translated(exc)
                if attempt == 2:
                    raise LockLost(
                        f"the LockHolder's session was lost while taking lock "
                        f"{request.describe()}: {main.lost_reason}") from exc
                # The session died under the try, which therefore holds nothing:
                # try once more on a new session.
        if got:
            assert main is not None
            return main
        if not request.wait or request.timeout == 0:
            metrics.busy(request.metric_name)
            raise (LockTimeout if request.timeout == 0 else LockBusy)(
                f"lock {request.describe()} is held by another session"
            )
        return await self._wait_elsewhere(deadline)

    async def _wait_elsewhere(self, deadline: float | None) -> _Carrier:
        """Wait on a connection of its own, so the main one stays free."""
        holder, request = self.holder, self.request
        carrier = await holder._waiting_carrier(request)
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        waiting = LockRequest(request.key, wait=True, timeout=remaining, shared=request.shared,
                              scope="session")
        try:
            await carrier.wait_lock(waiting.statement.inline)
        except BaseException as exc:
            # Whatever happened — timeout, deadlock, a cancel racing the grant —
            # the waiting connection is verified clean or closed.
            await holder._retire(carrier)
            if isinstance(exc, PgcoordError | asyncio.CancelledError):
                raise
            if carrier.lost:
                raise LockLost(f"the session waiting for lock {request.describe()} was lost: "
                               f"{carrier.lost_reason}") from exc
            mapped = request.translate(exc)
            if isinstance(mapped, LockTimeout):
                raise LockTimeout(
                    f"lock {request.describe()} not granted within {request.timeout}s"
                ) from exc
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
                if isinstance(exc, asyncio.CancelledError):
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
