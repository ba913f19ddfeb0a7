"""A scheduler's ``member=``: what its events mean for the scheduler.

Claims carry the member's name and session id (``Scheduler.runner``), so they
end with the session: when another member leaves, its running claims are
expired at once rather than when they time out; when this member's own session
ends, the bodies that ran under its claims are cut off. Schedule changes are
heard as notifications on the member's session, so the loop ticks at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .._core.aio import Supervisor
from . import schedules as _schedules
from .runs import Runs
from .store import Store

if TYPE_CHECKING:
    from ..member import Member

log = logging.getLogger("pgcoord.scheduler")


#: A scheduler on a member whose tick is longer than this (seconds) listens for
#: schedule changes; one that ticks this often finds them by its change counter.
LISTEN_ABOVE = 1.0

class MemberLink:
    """The scheduler's hooks on ``member`` (none without one), from ``hook()`` to the
    function it returns, for the length of a ``run()``. ``wake`` is the loop's:
    set, it ticks at once; ``recover_soon()`` has that tick look for lost claims."""

    def __init__(self, member: Member | None, runs: Runs, store: Store, wake: asyncio.Event,
                 recover_soon: Callable[[], None]) -> None:
        self._member = member
        self._runs = runs
        self._store = store
        self._wake = wake
        self._recover_soon = recover_soon
        self._unlisten: Callable[[], None] = lambda: None

    def hook(self) -> Callable[[], None]:
        """With a member: expire a dead member's claims at once, and stop our own
        bodies when our member's session (which their claims are tied to) ends.
        Returns the function that unhooks (and stops listening)."""
        member = self._member
        if member is None:
            return lambda: None
        tasks = Supervisor("scheduler member link", log)

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            tasks.spawn(coro, "pgcoord-scheduler-member", collected=True)

        def on_left(member_id: int) -> None:
            spawn(self._expire_claims_of(member_id))

        def on_session_lost(old_id: int) -> None:
            self._runs.cut_off_session(f"/{old_id}")
            # A change notified while the session is away is lost: tick (and read
            # the change counter) as soon as the member listens again, not at the
            # next tick, which may be `tick` seconds away.
            spawn(self._wake_when_rejoined(member, old_id))

        unhook_left = member.on_member_left(on_left)
        unhook_lost = member.on_session_lost(on_session_lost)
        self._unlisten = lambda: None

        def unhook() -> None:
            unhook_left()
            unhook_lost()
            self._unlisten()
            tasks.cancel()

        return unhook

    async def listen(self, tick: float) -> None:
        """With a member and a tick longer than ``LISTEN_ABOVE``, hear of schedule
        changes at once (NOTIFY on its session). Otherwise the tick's change counter
        finds them within ``tick``: a LISTEN on the member's session is signalled by
        every NOTIFY in the database, a tax on the application's own NOTIFY traffic
        that grows with the fleet (docs/members.md), not worth paying to hear a
        change sooner than within a second."""
        member = self._member
        if member is None or tick <= LISTEN_ABOVE:
            return

        def changed(_payload: str) -> None:
            # Tick now. The tick reads the change counter (committed before the
            # notification is delivered) and reloads only if it moved: a run owed
            # (payload 'owed') or a change already seen loads nothing.
            self._wake.set()

        try:
            self._unlisten = await member.listen(_schedules.SCHEDULES_CHANNEL, changed)
        except Exception as exc:  # the counter still finds every change
            log.warning("scheduler: cannot LISTEN for schedule changes, polling only: %r", exc)

    async def _wake_when_rejoined(self, member: Member, old_id: int) -> None:
        while True:
            await member.wait_joined()  # set again after the new session's LISTENs
            if member.id is not None and member.id != old_id:
                break
            await asyncio.sleep(0.05)  # still the old session's flag: not cleared yet
        self._wake.set()

    async def _expire_claims_of(self, member_id: int) -> None:
        try:
            expired = await self._store.expire_claims_of(member_id)
        except Exception as exc:  # the claims still expire on their own
            log.warning("scheduler: expiring the claims of member %d failed: %r", member_id, exc)
            return
        if expired:
            log.warning("scheduler: member %d is gone; %d running claim(s) of it expired now",
                        member_id, expired)
        # The watcher that found the death may have expired them already
        # (member_settle): look for them on this very tick either way.
        self._recover_soon()
        self._wake.set()
