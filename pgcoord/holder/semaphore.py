"""``holder.semaphore()``: a semaphore slot held by a ``LockHolder`` session.

The slot is a lane (see ``pgcoord.semaphores``) taken with
``pg_try_advisory_lock`` on the holder's main connection when one is free. When
none is, the wait goes to a *waiting connection* of its own, as a waited-for
lock does: it LISTENs there, enters the waiting room, tries on every
notification (and every ``SEMAPHORE_RECHECK``), and the lane it gets then lives
on that connection until released. A release unlocks the lane and notifies in
one statement, at once (never deferred: a waiter in another process is waiting
for exactly that). Losing the session cancels the body and raises ``LockLost``,
as for ``holder.lock()``.

Session locks are re-entrant, so one session must never take a lane it already
holds: the lanes held per connection in this process are passed to each try.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from .._core import errmap as _errmap
from .._core.aio import CleanupTimeout, absorb_cancel, finish_despite_cancel
from .._core.queries import query
from .._drivers.adapt import adapt
from ..errors import LockLost, PgcoordError
from ..locks import semaphores
from ..locks.semaphores import SEMAPHORE_RECHECK, SemaphoreRequest
from ..locks.semwait import CHANNEL
from ..observability import metrics

if TYPE_CHECKING:
    from ..locks.advisory import LockRequest
    from .carrier import Carrier
    from .holder import LockHolder

log = logging.getLogger("pgcoord.session")


# Lanes held through each driver connection by this process: (key, lane) -> count.
# Keyed by the driver's connection, which holders sharing one member's session share.
_held_lanes: dict[Any, collections.Counter[tuple[int, int]]] = {}


# One try at a time per driver connection: a try and the note of the lane it got
# must not interleave with another try on the same session. (asyncpg and psycopg
# connections take weak references.)
_try_locks: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


def _session_of(carrier: Carrier) -> Any:
    """The driver connection behind a carrier: holders on one member share it. An
    asyncpg pool's proxy stands for its Connection (which takes weak references)."""
    conn = carrier.conn.conn
    return adapt(conn).driver_connection(conn)


def _lanes_of(carrier: Carrier, key: int) -> list[int]:
    held = _held_lanes.get(_session_of(carrier))
    return [] if not held else [lane for (k, lane), n in held.items() if k == key and n]


def _note(carrier: Carrier, key: int, lane: int, delta: int) -> None:
    conn = _session_of(carrier)
    held = _held_lanes.setdefault(conn, collections.Counter())
    held[(key, lane)] += delta
    if held[(key, lane)] <= 0:
        del held[(key, lane)]
    if not held:
        del _held_lanes[conn]


def _release_later(holder: LockHolder, carrier: Carrier, request: SemaphoreRequest,
                   lane: int) -> None:
    """Release ``lane`` on a member's session once it is free, after this holder's
    carrier on it was given up (a release or try that overran its bound, a failed
    statement). The lane stays noted as held on that session until then, so no
    other holder of this process takes it meanwhile (a session lock is
    re-entrant, and this release would then take that holder's level away)."""
    member = holder._member
    incarnation = getattr(carrier.conn, "_incarnation", None)
    if member is None or member.id != incarnation:
        # No member, or its session is already gone (and the lane with it): nothing
        # to release, and a task spawned now might be cancelled before it forgets.
        _note(carrier, request.key, lane, -1)
        return

    async def release() -> None:
        try:
            if member.id == incarnation:
                await member._call(query("semaphore_release"), request.key, lane)
        except Exception as exc:
            log.warning("member %r: releasing %s failed: %r", member.name, request.describe(), exc)
        finally:
            _note(carrier, request.key, lane, -1)

    member._spawn(release(), f"pgcoord-member-semaphore:{member.name}")


def _sweep_later(holder: LockHolder, carrier: Carrier, request: SemaphoreRequest) -> None:
    """A try on a member's session got no answer within its bound: it may still
    have got a lane there. Once the session is free (and no other try of this
    process runs on it), release every lane of the key the session holds that no
    holder of this process has noted."""
    member = holder._member
    incarnation = getattr(carrier.conn, "_incarnation", None)
    if member is None:
        return
    session = _session_of(carrier)

    async def sweep() -> None:
        lock = _try_locks.get(session)
        if lock is None:
            lock = _try_locks[session] = asyncio.Lock()
        try:
            async with lock:
                if member.id != incarnation:
                    return
                own = await member._call(query("semaphore_own_lanes"), request.key) or []
                noted = _lanes_of(carrier, request.key)
                for lane in own:
                    if lane not in noted:
                        await member._call(query("semaphore_release"), request.key, lane)
        except Exception as exc:
            log.warning("member %r: releasing a stray lane of %s failed: %r", member.name,
                        request.describe(), exc)

    member._spawn(sweep(), f"pgcoord-member-semaphore:{member.name}")


async def _listen(carrier: Carrier, callback: Callable[[str], None]) -> Callable[[], Awaitable[None]]:
    """LISTEN on the waiting connection; returns how to stop hearing (the server's
    UNLISTEN comes with the statement that got the lane or gave up). A borrowed
    connection must go back with no listener of ours: asyncpg's pool warns of one."""
    unlisten = await carrier.conn.listen(CHANNEL, callback)

    async def stop() -> None:
        await unlisten(lost=carrier.lost)

    return stop


class HeldSemaphore:
    """One semaphore slot held through a :class:`LockHolder`. Single use at a time."""

    __slots__ = ("_entered", "carrier", "handed", "holder", "lane", "lost_in_own_task", "lost_reason",
                 "request")

    def __init__(self, holder: LockHolder, request: SemaphoreRequest) -> None:
        self.holder = holder
        self.request = request
        self.carrier: Carrier | None = None
        self.lane: int | None = None
        self.lost_reason: str | None = None
        self.lost_in_own_task = False  # see HeldLock
        #: Whether the lane's release on a member's session was handed to the
        #: background (by whoever came first: the carrier giving up, or the body).
        self.handed = False
        self._entered = False

    # -- what Carrier and LockHolder read of a holding ------------------------------

    @property
    def shared(self) -> bool:
        return False

    def release_on_shared_session(self) -> None:
        """The member's session outlives this holder's carrier (given up after an
        overrun, or the holder closed): release the lane there in the background,
        once."""
        if not self.handed and self.carrier is not None and self.lane is not None:
            self.handed = True
            _release_later(self.holder, self.carrier, self.request, self.lane)

    # -- taking --------------------------------------------------------------------------

    async def __aenter__(self) -> HeldSemaphore:
        if self._entered:
            raise RuntimeError("this semaphore slot is already in use; call holder.semaphore() again")
        self._entered = True
        started = time.monotonic()
        deadline = None if self.request.timeout is None else started + self.request.timeout
        try:
            carrier, lane = await self._take(deadline)
        except BaseException:
            self._entered = False
            raise
        self.carrier, self.lane, self.lost_reason, self.handed = carrier, lane, None, False
        self.lost_in_own_task = False
        carrier.holding[self] = asyncio.current_task()  # type: ignore[assignment]
        metrics.lock_wait(self.request.name, time.monotonic() - started)
        if carrier.dedicated:
            carrier.start_probe()
        return self

    async def _take(self, deadline: float | None) -> tuple[Carrier, int]:
        holder, request = self.holder, self.request
        main, lane = await holder._on_main(request.describe(), request, self._try_on)
        if lane is not None:
            return main, lane
        if not request.must_wait:
            raise request.busy()
        if self._own_lanes_in_task() >= request.limit:
            raise request.own_slots("this task")
        return await self._wait_elsewhere(deadline)

    def _own_lanes_in_task(self) -> int:
        """Lanes of this semaphore (below its limit) the current task holds through
        this holder: a task nested in as many slots as the limit would wait for
        itself (another task's slots may be released, so those are waited for)."""
        task, key, limit = asyncio.current_task(), self.request.key, self.request.limit
        return sum(
            1 for carrier in list(self.holder._carriers) for held, owner in carrier.holding.items()
            if owner is task and isinstance(held, HeldSemaphore) and held.request.key == key
            and held.lane is not None and 0 <= held.lane < limit)

    async def _try_on(self, main: Carrier) -> int | None:
        """A lane on the main connection, or None. The try runs to its end even if
        we are cancelled (it never waits), so that a lane it got is released."""
        task = asyncio.ensure_future(self._try_noted(main))
        try:
            lane = await finish_despite_cancel(task, bound=self.holder._cleanup_bound,
                                               on_timeout=main.overran)
        except CleanupTimeout as exc:
            main.mark_lost(f"a semaphore try got no answer within {self.holder._cleanup_bound:.1f}s")
            if main.shared:  # the member's session lives on, maybe with the lane
                _sweep_later(self.holder, main, self.request)
            raise LockLost(f"the LockHolder's session did not answer while taking "
                           f"{self.request.describe()}") from exc
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None:
                got = task.result()
                if got is not None:
                    await self._release_on(main, got)  # which forgets the note
            raise
        return lane

    async def _record(self, main: Carrier) -> None:
        """Name the lanes in pgcoord.semaphores: best effort, once per process."""
        request = self.request
        try:
            await main.call(query("semaphore_record"), request.name, request.key, request.limit)
        except Exception as exc:  # missing schema, no privilege, read-only
            if main.lost:
                raise
            log.debug("semaphore %r not recorded: %s", request.name, exc)
        semaphores.recorded.add((request.name, request.limit))

    async def _try_noted(self, main: Carrier) -> int | None:
        key, limit = self.request.key, self.request.limit
        if (self.request.name, limit) not in semaphores.recorded:
            await self._record(main)
        conn = _session_of(main)
        lock = _try_locks.get(conn)
        if lock is None:
            lock = _try_locks[conn] = asyncio.Lock()
        async with lock:
            skip = _lanes_of(main, key) or None
            try:
                lane = await main.call(query("semaphore_try_session"), key, limit, skip)
            except Exception as exc:
                if _errmap.sqlstate(exc) == _errmap.SQLSTATE_QUERY_CANCELED and not main.lost:
                    await self._release_strays(main)
                raise
            if lane is None:
                return None
            _note(main, key, int(lane), +1)
            return int(lane)

    async def _release_strays(self, main: Carrier) -> None:
        """The server cancelled a try part way (statement_timeout, an operator's
        pg_cancel_backend): a lane it took stays with the session, since session
        locks outlive the statement's error. Release the lanes of this key the
        session holds that no holder noted (the try lock is held); failing that,
        end the session, which releases them."""
        key = self.request.key
        try:
            own = await main.call(query("semaphore_own_lanes"), key) or []
            noted = _lanes_of(main, key)
            for lane in own:
                if lane not in noted:
                    await main.call(query("semaphore_release"), key, lane)
        except Exception as exc:
            if not main.lost:
                main.mark_lost(f"could not release a lane after a cancelled try: {exc!r}")
                if main.shared:
                    _sweep_later(self.holder, main, self.request)

    async def _wait_elsewhere(self, deadline: float | None) -> tuple[Carrier, int]:
        """Wait on a connection of its own, so the main one stays free."""
        holder, request = self.holder, self.request
        carrier = await holder._waiting_carrier(cast("LockRequest", request))
        woken = asyncio.Event()

        def on_notify(payload: str) -> None:
            if payload == str(request.key):
                woken.set()

        stop_listening = None
        noted: int | None = None
        try:
            stop_listening = await _listen(carrier, on_notify)
            enter = True
            while True:
                lane = await carrier.call(query("semaphore_wait_try"), request.key,
                                          request.limit, enter, None)
                enter = False
                if lane is not None:
                    noted = int(lane)
                    _note(carrier, request.key, noted, +1)
                    await stop_listening()  # the server stopped with the try that got it
                    return carrier, noted
                pause = SEMAPHORE_RECHECK
                if deadline is not None:
                    pause = min(pause, deadline - time.monotonic())
                    if pause <= 0:
                        raise request.timed_out()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), pause)
                woken.clear()
        except BaseException as exc:
            if noted is not None:  # the give-up frees it (or the connection goes)
                _note(carrier, request.key, noted, -1)
            await self._give_up(carrier, stop_listening)
            if isinstance(exc, PgcoordError | asyncio.CancelledError):
                raise
            if carrier.lost:
                raise LockLost(f"the session waiting for {request.describe()} was lost: "
                               f"{carrier.lost_reason}") from exc
            request.raise_translated(exc)

    async def _give_up(
        self, carrier: Carrier, stop_listening: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Stop listening (a borrowed connection goes back without a LISTEN), then
        give the waiting connection back, which releases its locks; bounded."""
        if not carrier.lost:
            try:
                await finish_despite_cancel(self._abandon(carrier, stop_listening),
                                            bound=self.holder._cleanup_bound,
                                            on_timeout=carrier.overran)
            except (CleanupTimeout, Exception) as exc:
                carrier.mark_lost(f"leaving a semaphore wait failed: {exc!r}")
        await self.holder._retire(carrier)

    async def _abandon(
        self, carrier: Carrier, stop_listening: Callable[[], Awaitable[None]] | None,
    ) -> None:
        await carrier.call(query("semaphore_wait_abandon"), self.request.key)
        if stop_listening is not None:
            await stop_listening()

    # -- releasing ---------------------------------------------------------------------

    async def _release_on(self, carrier: Carrier, lane: int) -> None:
        """Unlock the lane and notify the waiters in one statement, bounded; a
        release that fails or finds the lane not held ends the session (on a
        member's session, which lives on, the lane is released later)."""
        try:
            released = await finish_despite_cancel(
                carrier.call(query("semaphore_release"), self.request.key, lane),
                bound=self.holder._cleanup_bound, on_timeout=carrier.overran)
        except (CleanupTimeout, Exception) as exc:
            if not carrier.lost and not _errmap.session_gone(exc):
                carrier.mark_lost(f"releasing {self.request.describe()} failed: {exc!r}")
            elif not carrier.lost:
                carrier.mark_lost(f"{type(exc).__name__}: {exc}")
            self._after_lost(carrier, lane)
            return
        _note(carrier, self.request.key, lane, -1)
        if not released:
            log.error("pgcoord LockHolder session (pid %s): lane %d of %s was not held; "
                      "closing the session", carrier.conn.backend_pid, lane,
                      self.request.describe())
            carrier.mark_lost(f"lane {lane} of {self.request.describe()} was not held")

    def _after_lost(self, carrier: Carrier, lane: int) -> None:
        """The carrier is lost with ``lane`` unreleased: a member's session lives
        on, so the lane is released there later; otherwise it went with the session."""
        if carrier.shared:
            _release_later(self.holder, carrier, self.request, lane)
        else:
            _note(carrier, self.request.key, lane, -1)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        carrier, holder, request, lane = self.carrier, self.holder, self.request, self.lane
        assert carrier is not None and lane is not None
        carrier.holding.pop(self, None)
        try:
            if self.lost_reason is not None:
                if carrier.shared:  # unless the carrier's give-up handed it over already
                    self.release_on_shared_session()
                else:  # gone with the session, or with the give-back of a closing holder
                    _note(carrier, request.key, lane, -1)
                    if not carrier.lost:
                        carrier.wake_keys.add(request.key)
                self.carrier = self.lane = None
                metrics.lock_lost(request.name, self.lost_reason)
                if isinstance(exc, asyncio.CancelledError) or not self.lost_in_own_task:
                    absorb_cancel()  # ours, whatever came of it (see HeldLock.__aexit__)
                raise LockLost(f"{request.describe()} lost: {self.lost_reason}") from exc
            self.carrier = self.lane = None
            if carrier.lost:
                self._after_lost(carrier, lane)  # elsewhere released with the session
                return
            await self._release_on(carrier, lane)
            if carrier.dedicated:
                await holder._retire(carrier)
        finally:
            self._entered = False
