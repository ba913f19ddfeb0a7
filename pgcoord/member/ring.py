"""The member's watcher: its second session, waiting in the lock queue for the alive
lock of its successor in the ring (the live members of every group, by id).

When the successor's session ends the server grants the lock at once: the watcher
records the death (``member_reap``, which NOTIFYs everyone), tells its own member
without waiting for that NOTIFY to come back, gives the lock back and moves on to
the next successor. A change of ring moves a watcher blocked on a target that is no
longer the successor by cancelling its wait (``pg_cancel_backend`` from the main
session). docs/members.md tells the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._core import errmap as _errmap
from .._core.queries import query
from .._drivers.dedicated import HolderConnection
from .session import SessionLost

log = logging.getLogger("pgcoord.member")


class RingWatch:
    """One member's place in the ring. ``call`` runs a statement on the member's main
    session, ``spawn`` starts an owned task and ``told_dead(id, reason)`` tells the
    member that a peer is gone. ``run()`` raises when the watcher session fails; the
    member then opens another (``watch()``), and keeps its id and main session."""

    def __init__(self, name: str, ttl: float, own_id: Callable[[], int | None],
                 call: Callable[..., Awaitable[Any]], spawn: Callable[[Any, str], Any],
                 told_dead: Callable[[int, str], None]) -> None:
        self._name = name
        self._ttl = ttl
        self._own_id = own_id
        self._call = call
        self._spawn = spawn
        self._told_dead = told_dead
        #: Ids of every live member of every group, in ring order.
        self.ids: list[int] = []
        #: The watcher session while joined (None behind a pooler).
        self.session: HolderConnection | None = None
        self._session_lost = False
        self._target: int | None = None
        self._changed = asyncio.Event()

    def successor(self) -> int | None:
        own = self._own_id()
        others = [i for i in self.ids if i != own]
        if not others or own is None:
            return None
        return next((i for i in others if i > own), others[0])

    def retarget(self) -> None:
        """Move a watcher blocked on a target that is no longer our successor."""
        target = self._target
        if target is None or target == self.successor() or self.session is None:
            self._changed.set()
            return
        self._spawn(self._cancel_wait(), f"pgcoord-member-retarget:{self._name}")

    async def _cancel_wait(self) -> None:
        watcher = self.session
        if watcher is not None and self._target is not None:
            with contextlib.suppress(SessionLost):
                await self._call(query("member_cancel_watch"), watcher.backend_pid)

    def use(self, watcher: HolderConnection) -> None:
        """Watch on ``watcher`` from now on (a new watcher session)."""
        self.session, self._session_lost, self._target = watcher, False, None
        watcher.on_lost(lambda: self._on_session_lost(watcher))

    def _on_session_lost(self, watcher: HolderConnection) -> None:
        if watcher is not self.session:
            return  # an earlier watcher session, closed since
        self._session_lost = True
        self._changed.set()  # an idle watcher finds out now, not at its next probe

    async def run(self) -> None:
        """Watch successor after successor until the watcher session fails."""
        watcher = self.session
        assert watcher is not None
        while True:
            if self._session_lost:
                raise SessionLost("the member's watcher session is gone")
            target = self.successor()
            if target is None:
                await self._idle(watcher)
                continue
            self._target = target
            try:
                await watcher.fetchval(query("member_wait_alive"), target)
            except Exception as exc:
                self._target = None
                if _errmap.sqlstate(exc) == _errmap.SQLSTATE_QUERY_CANCELED:
                    # Moved on to another successor. The cancel may have landed
                    # just after the grant: let go of the lock if we got it.
                    await self._unwatch(watcher, target, held_or_not=True)
                    continue
                raise
            self._target = None
            # Granted: the target's session is gone. Tell everyone, then let go.
            try:
                reason = await self._call(query("member_reap"), target)
            except SessionLost:
                raise
            except Exception as exc:  # e.g. a lock_timeout: the heartbeat sweep will tell it
                log.warning("member %r: telling member %d's death failed: %r", self._name, target, exc)
                reason = None
            # Tell our own side now rather than when our NOTIFY comes back, and
            # move on past the dead member at once. No reason: it said goodbye,
            # and that news is still on its way to us.
            if target in self.ids:
                self._told_dead(target, reason or "left")
            await self._unwatch(watcher, target)

    async def _idle(self, watcher: HolderConnection) -> None:
        # Alone: nothing to wait for, but the watcher session must not go idle for
        # its idle_session_timeout (that is for a paused process).
        self._changed.clear()
        try:
            async with asyncio.timeout(self._ttl / 3):
                await self._changed.wait()
        except TimeoutError:
            try:
                await watcher.fetchval(query("holder_probe"))
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED:  # a late retarget
                    raise

    async def _unwatch(self, watcher: HolderConnection, target: int, *, held_or_not: bool = False) -> None:
        # A retarget's pg_cancel_backend may land on this statement: try again.
        for _ in range(5):
            try:
                if held_or_not:
                    await watcher.fetchval(query("member_unwatch_if_held"), target)
                else:
                    await watcher.fetchval(query("member_unwatch"), target)
                return
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED:
                    raise
        raise RuntimeError(f"could not give back member {target}'s alive lock")
