"""One connection of a ``LockHolder`` and the session locks it carries.

Every statement runs under the carrier's ``_io`` lock, one at a time. The main
connection also keeps the unlocks not yet sent: whoever takes ``_io`` next sends
them first (the next lock's try, in the same statement), or a flush on the
event loop's next turn. A carrier that finds its session gone (the driver says
so, a probe gets no answer, an unlock finds nothing held) cancels every body
holding a lock on it and closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from .._core import errmap as _errmap
from .._core.aio import CleanupTimeout, consume_result, finish_despite_cancel
from .._core.queries import query
from .._drivers.dedicated import HolderConnection
from ..errors import LockLost, PgcoordError
from ..locks.advisory import LockRequest

if TYPE_CHECKING:
    from .holder import HeldLock, LockHolder
    from .semaphore import HeldSemaphore

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
_SEMAPHORE_WAKE = query("semaphore_wake")

def _is_lane(held: object) -> bool:
    """Whether a holding is a semaphore's lane (a two-int lock) rather than a key."""
    return hasattr(held, "lane")




class Carrier:
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
        self.holding: dict[HeldLock | HeldSemaphore, asyncio.Task[Any]] = {}
        #: Semaphore keys whose lanes a body left to this carrier's give-back
        #: (the holder is closing): their waiters are told once it is done.
        self.wake_keys: set[int] = set()
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

    async def call(self, sql: str, *args: Any) -> Any:
        """One statement of another session-level feature on this connection (a
        semaphore's try or release), after the unlocks not yet sent; its first value."""
        self._check_usable()
        async with self._io:
            self._check_usable()
            self._io_owner = "user"
            try:
                await self._send_unlocks()
                return await self.conn.fetchval(sql, *args)
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
        if code is not None and code != _errmap.SQLSTATE_QUERY_CANCELED:
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
            if not done and self._io_owner not in (None, "probe"):
                # Still queued behind a statement of a bounded cleanup (an unlock,
                # an undo), whose own bound decides about the session: wait for it.
                done, _ = await asyncio.wait({probe}, timeout=self.holder._cleanup_bound + interval)
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
                    if _is_lane(held):  # two-int, released its own way
                        held.release_on_shared_session()  # type: ignore[union-attr]
                    else:
                        owned[(held.request.key, held.request.shared)] += 1  # type: ignore[union-attr]
        self._unlock_exclusive, self._unlock_shared = [], []
        log.warning("pgcoord LockHolder session (pid %s) lost: %s; %d lock(s) lost",
                    self.conn.backend_pid, reason, len(self.holding))
        for held, task in list(self.holding.items()):
            if held.lost_reason is None:  # else already told (the holder is closing): once
                held.lost_reason = reason
                held.lost_in_own_task = task is asyncio.current_task()
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
        # Read now: the bodies told to stop leave `holding` while this runs.
        lane_keys = {held.request.key for held in self.holding if _is_lane(held)}
        try:
            async with self._io:
                self._io_owner = "cleanup"
                # A body that got its lock while the holder was closing (a wait
                # granted, a try answered, as close() awaited): told before the
                # give-back releases its lock under it, as close() tells the others.
                self._tell_holding("the LockHolder was closed while the lock was held")
                self._unlock_exclusive, self._unlock_shared = [], []
                row = await self.conn.fetchrow(_GIVE_BACK, *self.saved)
                assert row is not None
                if row[0] != 0:
                    raise PgcoordError(f"{row[0]} advisory lock(s) still held after unlock_all")
                # Lanes of bodies still holding went with unlock_all: tell their waiters.
                lane_keys |= self.wake_keys
                lane_keys |= {held.request.key for held in self.holding if _is_lane(held)}
                for key in lane_keys:
                    await self.conn.fetchval(_SEMAPHORE_WAKE, key)
            await self.conn.give_back()
            self._discarded = True
        except BaseException as exc:
            log.warning("pgcoord LockHolder: closing the connection instead of giving it back: %r",
                        exc)
            await self.discard()
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _tell_holding(self, reason: str) -> None:
        """Cancel each body still holding a lock on this session, but the closing task."""
        for held, task in list(self.holding.items()):
            if held.lost_reason is None and task is not self.holder._closing_task:
                held.lost_reason = reason
                task.cancel(f"pgcoord: lock lost: {reason}")

    async def _let_go_of_shared(self) -> None:
        """Retire on a member's session: send the unlocks not yet sent and undo the
        locks still held by bodies, key by key; the session itself stays."""
        # Lanes go through the member in the background, once each (a body told
        # to stop may hand its own over first): the session is the member's.
        for held in list(self.holding):
            if _is_lane(held):
                held.release_on_shared_session()  # type: ignore[union-attr]
        try:
            async with self._io:
                self._io_owner = "cleanup"
                self._tell_holding("the LockHolder was closed while the lock was held")
                await self._send_unlocks()
                keys = [(held.request.key, held.request.shared)  # type: ignore[union-attr]
                        for held in list(self.holding) if not _is_lane(held)]
                await self._undo(keys)
        finally:
            self.conn.terminate()
            self._discarded = True
