"""The tenure engine: one holding of a lease, from its take to its release.

A ``Lease``, an ``Elector``'s term, a part of ``Partitions`` and a job claim are all
the same thing underneath: a row taken with a fence, believed in only inside a
trust window on the monotonic clock, renewed well inside it, and lost when a
renewal fails for good, the row is taken over, the window closes or the session it
is tied to ends. What each feature does with a loss (cancel a body until it ends)
and how it lets go (doorbell and row, in the order its waiters need) is written
here once. docs/architecture.md, "The life of a lease", tells the whole story.

Rules that hold by construction:

- A ``Tenure`` is made before anything is taken, one per attempt, and its loss is
  never reset: a session lost while the row is being taken is still known once the
  row is ours (the take is then undone, never handed out valid).
- A doorbell rung on a member's session is dropped on every way out of the attempt
  that rang it, cancellation included, unless the attempt hands it to its tenure.
- A graceful release, of a ``Lease`` or an ``Elector``'s term, lets go of the row
  first, then of the doorbell, then pokes the waiters on members: while the bell is
  held nobody may take the row over, and a waiter that rang between a bell let go of
  first and the row's release took the row from under it (the release went untold).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .._core import readonly
from .._core.aio import consume_result
from .._core.errmap import session_gone
from .._core.queries import query
from ..keys import lock_key
from ..observability import metrics

log = logging.getLogger("pgcoord.tenure")

K = TypeVar("K", bound=Hashable)


def trust_margin(window: float) -> float:
    """How much earlier than the server a holder stops believing: 10%, at most 1 s."""
    return min(window * 0.1, 1.0)


def trusted_until(sent: float, window: float) -> float:
    """The end of a trust window opened by a renewal sent at ``sent`` (monotonic)."""
    return sent + window - trust_margin(window)


def doorbell_key(name: str) -> int:
    """The session lock a lease's holder keeps so that its death is news at once
    (``pgcoord.lease_doorbell_key(name)`` in SQL)."""
    return lock_key(f"pgcoord.elector:{name}")


class TrustWindow:
    """Until when a holder may believe it holds: the send time of its last renewal
    that succeeded, plus the shortest time after which anyone else may take over
    (``window``), less a margin. Read on the monotonic clock, so it closes on time
    also across a pause of the whole process."""

    __slots__ = ("until", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self.until = 0.0

    def trust(self, sent: float) -> None:
        self.until = trusted_until(sent, self.window)

    def close(self) -> None:
        self.until = 0.0

    def is_open(self) -> bool:
        return time.monotonic() < self.until

    def left(self) -> float:
        return max(0.0, self.until - time.monotonic())


class Tenure:
    """One holding: its fence, its trust window, and whether (and why) it is lost.

    ``lose()`` records the first reason only and tells every ``on_lost`` listener
    once; a listener added after the loss is told at once."""

    def __init__(self, name: str, window: float) -> None:
        self.name = name
        self.fence: int | None = None
        self.trust = TrustWindow(window)
        self.renewed_at = 0.0
        self.lost: str | None = None
        self.lost_event = asyncio.Event()
        self._listeners: list[Callable[[str], None]] = []

    @property
    def valid(self) -> bool:
        return self.fence is not None and self.lost is None and self.trust.is_open()

    def taken(self, fence: int, sent: float) -> None:
        self.fence, self.renewed_at = fence, sent
        self.trust.trust(sent)

    def renewed(self, sent: float, *, record: bool = True) -> None:
        """A renewal sent at ``sent`` (monotonic) succeeded: trust from then on. Once
        the holding is lost, a renewal that was in flight changes nothing."""
        if self.lost is not None:
            return
        if record:
            metrics.renewal(self.name, time.monotonic() - sent, sent - self.renewed_at)
        self.renewed_at = sent
        self.trust.trust(sent)

    def on_lost(self, listener: Callable[[str], None]) -> None:
        if self.lost is not None:
            listener(self.lost)
        else:
            self._listeners.append(listener)

    def lose(self, reason: str) -> bool:
        """Record the loss (the first reason wins); True if this call lost it."""
        if self.lost is not None:
            return False
        self.lost = reason
        self.trust.close()
        self.lost_event.set()
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                log.exception("tenure %r: a loss listener failed", self.name)
        return True


@dataclass(frozen=True)
class Renewal:
    """How a holding is renewed. ``renew()`` returns None when the row is no longer
    ours (expired or taken over) and anything else when renewed. It runs every
    ``every`` seconds; one that raises is tried again ``retry_every`` seconds later
    while the trust window is open, unless ``fatal(error)`` says it cannot succeed; one
    that has not answered when the window closes is given up on (``abandon()`` cuts its
    connection) and the tenure is lost (``starved()`` may add why)."""

    renew: Callable[[], Awaitable[Any]]
    every: float
    retry_every: float
    abandon: Callable[[], None] | None = None
    fatal: Callable[[BaseException], bool] | None = None
    starved: Callable[[], str] | None = None


async def keep_renewed(tenure: Tenure, how: Renewal,
                       on_renewed: Callable[[Any], None] | None = None) -> None:
    """Renew ``tenure`` until it is lost (or this task is cancelled, by a release):
    ``renew_once`` in a loop, for a holder whose renewals run in a task of their own
    (a ``Lease``). A renewal in flight when this is cancelled is cancelled and
    abandoned."""
    next_at = tenure.renewed_at + how.every
    try:
        while tenure.lost is None:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if tenure.lost is not None:
                return
            next_at, result = await renew_once(tenure, how, abandon_on_cancel=True)
            if result is not None and on_renewed is not None:
                on_renewed(result)
    except Exception as exc:
        # Not the database (that is retried): a bug. The loop is over, so stop
        # believing now rather than when the window closes, unannounced.
        log.exception("tenure %r: the renewal loop failed", tenure.name)
        tenure.lose(f"the renewal loop failed: {exc!r}")


async def renew_once(tenure: Tenure, how: Renewal, *,
                     abandon_on_cancel: bool = False) -> tuple[float, Any]:
    """One renewal of ``tenure`` as ``how`` says, bounded by its trust window; returns
    when the next one is due (infinite after a loss) and what ``renew()`` returned
    (None unless renewed). Cancelled meanwhile, the renewal in flight is left to
    finish, unless ``abandon_on_cancel`` (then it is cancelled and abandoned)."""
    renew, every, retry_every = how.renew, how.every, how.retry_every
    abandon, fatal, starved = how.abandon, how.fatal, how.starved
    sent = time.monotonic()
    attempt = asyncio.ensure_future(renew())
    try:
        done, _ = await asyncio.wait({attempt}, timeout=max(0.0, tenure.trust.until - sent))
    except asyncio.CancelledError:
        if abandon_on_cancel:
            attempt.cancel()
            if abandon is not None:
                abandon()
        attempt.add_done_callback(consume_result)
        raise
    if not done:
        attempt.cancel()
        attempt.add_done_callback(consume_result)
        if abandon is not None:
            abandon()
        tenure.lose("no renewal succeeded before the trust window closed"
                    + (starved() if starved is not None else ""))
        return math.inf, None
    error = attempt.exception()
    if error is None:
        result = attempt.result()
        if result is None:
            tenure.lose("the lease expired or was taken over")
            return math.inf, None
        tenure.renewed(sent)
        # Its failures go unkeyed: a holding is dropped on many paths (a part given
        # back, a slot recorded) without a last renewal that would clear a key.
        readonly.writable("tenure")
        return sent + every, result
    if fatal is not None and fatal(error):
        tenure.lose(f"renewal failed: {error}")
        return math.inf, None
    # Not a loss while the trust window is open: try again soon.
    readonly.retrying(log, error, "renewing %r failed, retrying: %r", tenure.name, error)
    left = tenure.trust.left()
    if left <= 0.0:
        tenure.lose(f"renewal failed until the trust window closed: {error!r}")
        return math.inf, None
    return time.monotonic() + min(retry_every, left), None


def settle_batch(tenures: Mapping[K, Tenure], sent: float, renewed: Collection[K],
                 ours: Collection[K]) -> list[K]:
    """The answer to one statement that renewed many holdings at once (a member's
    parts), sent at ``sent``: each in ``renewed`` is trusted anew; each no longer
    ``ours`` is lost, taken over; one still ours but not renewed (its row was busy)
    keeps the window it had. Returns the keys this answer lost."""
    lost = []
    for key, tenure in tenures.items():
        if key in renewed:
            tenure.renewed(sent, record=False)
        elif key not in ours and tenure.lose("the lease expired or was taken over"):
            lost.append(key)
    return lost


def close_expired(tenures: Iterable[Tenure], now: float) -> list[Tenure]:
    """Lose each holding whose trust window has closed by ``now`` (no renewal
    answered in time); returns those this call lost."""
    return [t for t in tenures
            if t.lost is None and t.trust.until <= now
            and t.lose("no renewal succeeded before the trust window closed")]


class Doorbell:
    """A lease's doorbell on one session: a session lock that is free the moment that
    session ends, so that whoever waits for the lease can take it over at once.

    The session is the holder's own (an ``Elector(dsn)``: closing it lets go of the
    bell) or a member's shared one, whose ``owned`` book (what the member unlocks when
    a feature lets go) is kept here, for the levels this bell took. ``call`` runs a
    statement on the session (the owner's, which maps its errors); by default the
    session's own ``fetchval``."""

    def __init__(self, session: Any, name: str,
                 call: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.session = session
        self.key = doorbell_key(name)
        self._call = call or session.fetchval
        self._book: Counter[tuple[int, bool]] | None = getattr(session, "owned", None)
        self.held = False

    @property
    def pid(self) -> int:
        return int(self.session.backend_pid)

    def _booked(self, delta: int) -> None:
        book = self._book
        if book is not None:
            book[(self.key, False)] += delta
            if book[(self.key, False)] <= 0:
                del book[(self.key, False)]

    async def ring(self) -> bool:
        """Take the bell without waiting; False while another session holds it.

        Session locks are re-entrant, and another feature of the same member may hold
        this bell already: so only a level this try is known to have taken is ever
        booked or undone. A ring cancelled in flight lets its statement finish, and a
        level it turns out to have taken is unlocked then (never one it did not)."""
        attempt = asyncio.ensure_future(self._call(
            query("advisory_call").format(fn="pg_try_advisory_lock"), self.key))
        try:
            rang = bool(await asyncio.shield(attempt))
        except asyncio.CancelledError:
            attempt.add_done_callback(self._undo_late_ring)
            raise
        if rang:
            self._booked(+1)
            self.held = True
        return rang

    def _undo_late_ring(self, attempt: asyncio.Future[Any]) -> None:
        if attempt.cancelled() or attempt.exception() is not None or not attempt.result():
            return
        unlock_later = getattr(self.session, "unlock_later", None)
        if unlock_later is not None:  # an own session lets go of it when it is closed
            unlock_later(self.key)

    def rang(self) -> None:
        """The bell was taken by a wait of the owner's own (``pg_advisory_lock``)."""
        self._booked(+1)
        self.held = True

    async def unring(self) -> None:
        """Unlock now and wait for it, so that a waiter woken next finds it free. The
        level is unbooked before the unlock is sent, and the unlock is not cut short
        by a cancellation: a later ``drop()`` never unlocks a level twice."""
        if self.held:
            self.held = False
            self._booked(-1)
            unlock = asyncio.ensure_future(self._call(
                query("advisory_call").format(fn="pg_advisory_unlock"), self.key))
            unlock.add_done_callback(consume_result)  # also when we stop waiting for it
            await asyncio.shield(unlock)

    def drop(self) -> None:
        """Let go without waiting: what is still owed on a member's session is
        unlocked in the background by the member (on an own session, closing it
        does)."""
        self.held = False
        book = self._book
        owed = 0 if book is None else book.pop((self.key, False), 0)
        if owed > 0:
            self.session.unlock_later(self.key, owed)

    async def bind(self, name: str, holder: str, fence: int) -> bool:
        """The lease was taken without the bell (after a quiet wait, or while the old
        holder's session was ending): take the bell now and tie the lease to this
        session, so that the holder's own death is heard at once. The bell may still
        be held for a moment by a contender that lost: a few tries."""
        for attempt in range(5):
            if await self.ring():
                try:
                    bound = bool(await self._call(query("lease_bind_session"), name, holder, fence,
                                                  self.pid))
                except Exception as exc:
                    if session_gone(exc):
                        raise
                    # A lock_timeout on a member's session: stay unbound.
                    log.warning("lease %r: tying it to the session failed: %r", name, exc)
                    bound = False
                if not bound:
                    await self.unring()
                return bound
            await asyncio.sleep(0.01 * (attempt + 1))
        log.warning("lease %r: held with fence %d without its doorbell (held elsewhere): if this "
                    "process dies, the lease is free only when it expires", name, fence)
        return False
