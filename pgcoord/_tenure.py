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
- A graceful release on a member's session lets go of the doorbell first, awaited,
  and then of the row, whose notification wakes the waiters: they find both free.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import metrics
from ._aio import consume_result
from ._keys import lock_key
from ._queries import query

if TYPE_CHECKING:
    from .member import MemberSession

log = logging.getLogger("pgcoord.tenure")


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


async def keep_renewed(
    tenure: Tenure,
    renew: Callable[[], Awaitable[Any]],
    *,
    every: float,
    retry_every: float,
    abandon: Callable[[], None] | None = None,
    fatal: Callable[[BaseException], bool] | None = None,
    on_renewed: Callable[[Any], None] | None = None,
    starved: Callable[[], str] | None = None,
) -> None:
    """Renew ``tenure`` every ``every`` seconds until it is lost (or this task is
    cancelled, by a release): ``renew_once`` in a loop, for a holder whose renewals
    run in a task of their own (a ``Lease``). A renewal in flight when this is
    cancelled is cancelled and abandoned."""
    next_at = tenure.renewed_at + every
    try:
        while tenure.lost is None:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if tenure.lost is not None:
                return
            next_at, result = await renew_once(
                tenure, renew, every=every, retry_every=retry_every, abandon=abandon, fatal=fatal,
                starved=starved, abandon_on_cancel=True)
            if result is not None and on_renewed is not None:
                on_renewed(result)
    except Exception as exc:
        # Not the database (that is retried): a bug. The loop is over, so stop
        # believing now rather than when the window closes, unannounced.
        log.exception("tenure %r: the renewal loop failed", tenure.name)
        tenure.lose(f"the renewal loop failed: {exc!r}")


async def renew_once(
    tenure: Tenure,
    renew: Callable[[], Awaitable[Any]],
    *,
    every: float,
    retry_every: float,
    abandon: Callable[[], None] | None = None,
    fatal: Callable[[BaseException], bool] | None = None,
    starved: Callable[[], str] | None = None,
    abandon_on_cancel: bool = False,
) -> tuple[float, Any]:
    """One renewal of ``tenure``, bounded by its trust window; returns when the next
    one is due and what ``renew()`` returned (None unless renewed).

    ``renew()`` returns None when the row is no longer ours (expired or taken over)
    and anything else when renewed. A renewal that raises is tried again
    ``retry_every`` seconds later while the trust window is open, unless
    ``fatal(error)`` says it cannot succeed; one that has not answered when the
    window closes is given up on (``abandon()`` cuts its connection) and the tenure
    is lost (``starved()`` may add why). After a loss the next time is infinite.
    Cancelled meanwhile, the renewal in flight is left to finish, unless
    ``abandon_on_cancel`` (then it is cancelled and abandoned)."""
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
        metrics.renewal(tenure.name, time.monotonic() - sent, sent - tenure.renewed_at)
        tenure.renewed_at = sent
        tenure.trust.trust(sent)
        return sent + every, result
    if fatal is not None and fatal(error):
        tenure.lose(f"renewal failed: {error}")
        return math.inf, None
    # Not a loss while the trust window is open: try again soon.
    log.warning("renewing %r failed, retrying: %r", tenure.name, error)
    left = tenure.trust.left()
    if left <= 0.0:
        tenure.lose(f"renewal failed until the trust window closed: {error!r}")
        return math.inf, None
    return time.monotonic() + min(retry_every, left), None


class MemberBell:
    """A lease's doorbell on a member's session: a session lock that is free the
    moment the session ends, so that whoever waits can take the lease over at once.

    Taken with a try (a member's session is shared: it never waits), and counted in
    the session's ``owned`` before the statement is sent, so that a ring cancelled
    in flight is still undone by ``drop()``."""

    def __init__(self, session: MemberSession, name: str) -> None:
        self.session = session
        self.key = doorbell_key(name)
        self._held = False

    @property
    def pid(self) -> int:
        return self.session.backend_pid

    async def ring(self) -> bool:
        """Take the doorbell without waiting; False while another session holds it.
        ``SessionLost`` when the member's session is gone."""
        owned = self.session.owned
        owned[(self.key, False)] += 1  # an unlock is owed from here on, whatever comes back
        # Raised or cancelled in flight, the lock may have been taken: the unlock stays
        # owed, and drop() pays it.
        rang = bool(await self.session.fetchval(
            query("advisory_call").format(fn="pg_try_advisory_lock"), self.key))
        if not rang:
            owned[(self.key, False)] -= 1
        self._held = rang
        return rang

    async def let_go(self) -> None:
        """Unlock now and wait for it, so that a waiter woken next finds it free. On
        failure (the session is gone, or busy past its bound) fall back to ``drop``."""
        if self._held:
            self._held = False
            try:
                await self.session.fetchval(query("advisory_call").format(fn="pg_advisory_unlock"),
                                            self.key)
                self.session.owned[(self.key, False)] -= 1
            except Exception as exc:
                log.info("doorbell %d: unlock failed (%r); left to the member", self.key, exc)
        self.drop()

    def drop(self) -> None:
        """Let go without waiting: what is still owed is unlocked in the background
        by the member (or went with its session)."""
        self._held = False
        self.session.terminate()
