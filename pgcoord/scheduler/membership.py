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
from .runs import Runs
from .store import Store

if TYPE_CHECKING:
    from ..member import Member

log = logging.getLogger("pgcoord.scheduler")


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

    async def listen(self) -> None:
        """Schedule changes are found by the tick's change counter (at most ``tick``
        seconds), with a member or without: a LISTEN on the member's session would
        be signalled by every NOTIFY in the database, a tax on the application's own
        NOTIFY traffic that grows with the fleet (docs/members.md)."""
        return

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
