"""The member's watcher: its second session, waiting in the lock queue for the alive
lock of its successor in the ring (the live members of every group, by id).

When the successor's session ends the server grants the lock at once, and the same
statement (``member_wait_reap``) records every death it finds and tells it in one
NOTIFY, heard by those who listen. The watcher tells its own member without waiting
for that NOTIFY to come back, settles what the dead held, gives the lock back and
moves on to the next successor. A change of ring moves a watcher blocked on a target
that is no longer the successor by cancelling its wait (``pg_cancel_backend`` from
the main session). docs/members.md tells the whole story.

The watcher is also how a member is woken without a broadcast. Before PostgreSQL 19
every NOTIFY signals every listening session of the database, so a fleet whose
every member LISTENs taxes the application's own NOTIFY traffic (docs/members.md,
"What a member costs"). A feature that waits for a lease (a member-bound elector's
follower, a waiting ``Lease``) *stands* for it: the watcher holds the lease's
candidacy lock, a shared session lock, while it waits. Whoever frees the lease (its
holder releasing it, or the watcher that finds its holder's member dead) cancels the
wait of each session holding that candidacy lock (``pg_cancel_backend``): one signal
to each candidate, none to anyone else. A cancelled wait is news: the member's
candidates look again at once, and the ring is read afresh. A poke that lands
between two of the watcher's statements is lost; the candidates then look at their
next third of a ttl, as before.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._core import errmap as _errmap
from .._core.queries import query
from .._drivers.dedicated import HolderConnection
from ..keys import lock_key
from .session import SessionLost

log = logging.getLogger("pgcoord.member")


# How often a member alone in the ring looks for company, besides being told.
LONE_LOOK_EVERY = 1.0

#: Errors of a reap after its grant that another watcher's reap of the same deaths can
#: cause (both mark the same rows): the round is tried again.
_REAP_RACES = frozenset({_errmap.SQLSTATE_DEADLOCK, _errmap.SQLSTATE_SERIALIZATION_FAILURE,
                         _errmap.SQLSTATE_LOCK_NOT_AVAILABLE})


def candidacy_key(lease: str) -> int:
    """The shared session lock a candidate for ``lease`` holds on its watcher session
    (``pgcoord.lock_key('pgcoord.candidate:' || name)`` in SQL)."""
    return lock_key(f"pgcoord.candidate:{lease}")


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
        self._ids: list[int] = []
        self._session: HolderConnection | None = None
        self._session_lost = False
        self._target: int | None = None
        self._waiting = False  # the watcher is in a wait that a cancel ends
        # Nudges asked for, and how many of them the watcher's latest round had seen
        # when it started (each round syncs the stands, then looks at its successor).
        self._asked = 0
        self._looked = 0
        self._nudging = False  # a _cancel_wait is under way
        #: Candidacies: lock key -> what to wake when it is poked.
        self._stands: dict[int, list[Callable[[], None]]] = {}
        self._taken: set[int] = set()  # candidacy locks held on the current session
        #: Set when the ring was read afresh by the watcher itself (see ``fresh_ring``).
        self.fresh_ring: Callable[[], Awaitable[None]] | None = None

    @property
    def ids(self) -> list[int]:
        """Ids of every live member of every group, in ring order (ascending)."""
        return self._ids

    @ids.setter
    def ids(self, ids: list[int]) -> None:
        # Kept sorted, so that finding the successor is a bisection: a crash told to a
        # process's members is looked up once per member and death, with thousands of
        # ids in the ring.
        self._ids = sorted(ids)

    def drop(self, member_id: int) -> bool:
        """Take ``member_id`` out of the ring; False if it was not in it."""
        at = bisect.bisect_left(self._ids, member_id)
        if at < len(self._ids) and self._ids[at] == member_id:
            del self._ids[at]
            return True
        return False

    @property
    def session(self) -> HolderConnection | None:
        """The watcher session while joined (None behind a pooler)."""
        return self._session

    @session.setter
    def session(self, session: HolderConnection | None) -> None:
        if session is not self._session:
            self._session = session
            self._taken = set()  # a new session holds none of them

    def stand(self, lease: str, poke: Callable[[], None]) -> Callable[[], None]:
        """Stand for ``lease``: ``poke()`` is called when its holder lets it go or dies
        (and when anything else wakes the watcher). Returns the withdrawal."""
        key = candidacy_key(lease)
        self._stands.setdefault(key, []).append(poke)
        self._nudge()

        def withdraw() -> None:
            pokes = self._stands.get(key)
            if pokes is not None and poke in pokes:
                pokes.remove(poke)
                if not pokes:
                    del self._stands[key]
                    self._nudge()

        return withdraw

    def poked(self) -> None:
        """Wake every candidate of this member."""
        for pokes in list(self._stands.values()):
            for poke in list(pokes):
                try:
                    poke()
                except Exception:
                    log.exception("member %r: a candidate's wake-up failed", self._name)

    def _nudge(self) -> None:
        """Have the watcher look again now: cut its wait short, once it is in one."""
        self._asked += 1
        if self._session is not None and not self._nudging:
            self._nudging = True
            self._spawn(self._cancel_wait(), f"pgcoord-member-retarget:{self._name}")

    def successor(self) -> int | None:
        """The next live member after ours in id order, wrapping round; None alone."""
        own, ids = self._own_id(), self._ids
        if own is None or not ids:
            return None
        at = bisect.bisect_right(ids, own)
        if at < len(ids):
            return ids[at]
        return ids[0] if ids[0] != own else None

    def retarget(self, *, stands: bool = True) -> None:
        """Move a watcher blocked on a target that is no longer our successor, or (with
        ``stands``: a look from outside the watcher's round, such as the heartbeat's)
        one that does not hold the candidacies it should."""
        target = self._target
        if target is not None and target == self.successor() and (
                not stands or set(self._stands) == self._taken):
            return
        self._nudge()

    async def _cancel_wait(self) -> None:
        """Until the watcher has started a round after the last nudge (a round syncs
        its stands and looks at its successor afresh): cancel its wait whenever it is
        in one. One cancel is not enough: sent while the watcher is between two
        statements (just before its wait, or while it runs another), the server
        drops it, and the wait that follows may last as long as its target lives."""
        watcher, pause, seen = self._session, 0.01, -1
        try:
            while (watcher is not None and watcher is self._session and self._looked < self._asked
                   and not self._session_lost):
                if seen != self._asked:  # a new nudge: quick again
                    seen, pause = self._asked, 0.01
                if self._waiting:
                    try:
                        await self._call(query("member_cancel_watch"), watcher.backend_pid)
                    except SessionLost:
                        return
                    except Exception as exc:  # an operator's cancel of ours: ask again
                        log.debug("member %r: cancelling the watcher's wait failed: %r", self._name, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.25)
        finally:
            self._nudging = False

    async def _sync_stands(self, watcher: HolderConnection) -> None:
        """Hold the candidacy locks of what this member stands for, and only those."""
        for key in set(self._stands) - self._taken:
            await watcher.fetchval(query("advisory_call").format(fn="pg_try_advisory_lock_shared"), key)
            self._taken.add(key)
        for key in self._taken - set(self._stands):
            self._taken.discard(key)
            await watcher.fetchval(query("advisory_call").format(fn="pg_advisory_unlock_shared"), key)

    async def _woken(self) -> None:
        """The watcher was cancelled or found a death: tell the candidates, and read
        the ring afresh (a member that listens hears of joins; one that does not
        learns of them here, from the joiner's poke, or at its heartbeat)."""
        self.poked()
        if self.fresh_ring is not None:
            await self.fresh_ring()

    def use(self, watcher: HolderConnection) -> None:
        """Watch on ``watcher`` from now on (a new watcher session)."""
        self.session, self._session_lost, self._target = watcher, False, None
        watcher.on_lost(lambda: self._on_session_lost(watcher))

    def _on_session_lost(self, watcher: HolderConnection) -> None:
        if watcher is self._session:  # not an earlier watcher session, closed since
            self._session_lost = True

    async def run(self) -> None:
        """Watch successor after successor until the watcher session fails."""
        watcher = self._session
        assert watcher is not None
        while True:
            self._looked = self._asked
            if self._session_lost:
                raise SessionLost("the member's watcher session is gone")
            try:
                await self._sync_stands(watcher)
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED:
                    raise
                await self._woken()
                continue
            target = self.successor()
            if target is None:
                await self._idle(watcher)
                continue
            self._target = target
            self._waiting = True
            try:
                # Granted, the target's session is gone: the same statement marks it
                # and whoever died with it (often its neighbours in the ring) gone,
                # and tells them.
                raw = await watcher.fetchval(query("member_wait_reap"), target)
            except Exception as exc:
                self._target = None
                code = _errmap.sqlstate(exc)
                if code == _errmap.SQLSTATE_QUERY_CANCELED or code in _REAP_RACES:
                    # Moved on to another successor, or poked; or the reap after the
                    # grant lost a race with another watcher's. The cut may have
                    # landed after the grant: let go of the lock if we got it.
                    self._waiting = False
                    if await self._unwatch(watcher, target, held_or_not=True):
                        # Granted before the cut (in the wait for its siblings, or
                        # its reap): its session is gone, and a fresh read of the ring
                        # no longer lists it, so nobody else would tell it before the
                        # next sweep. Tell it now, without waiting for the siblings.
                        await self._settle(target, await self._reap_now(target))
                    await self._woken()
                    continue
                raise
            finally:
                self._waiting = False
            self._target = None
            await self._settle(target, raw)
            await self._unwatch(watcher, target)
            await self._woken()

    async def _reap_now(self, target: int) -> str:
        """``member_reap_dead`` on the main session: every dead member, marked and told
        (``[]`` if it fails: the heartbeat's sweep still tells them)."""
        try:
            return str(await self._call(query("member_reap_dead")))
        except SessionLost:
            raise
        except Exception as exc:
            log.warning("member %r: telling member %d's death failed: %r", self._name, target, exc)
            return "[]"

    async def _settle(self, target: int, raw: str) -> None:
        """After ``target`` was found dead and the dead were told (``raw``, the reap's
        ``[[id, reason], ...]``): settle what they held that others wait for (their
        leases' candidates are woken, their job claims expired), and tell our own
        side now rather than when our NOTIFY comes back."""
        try:
            # (Those marked already were told by whoever marked them.)
            dead = {int(i): why for i, why in json.loads(raw) if why is not None}
            dead.setdefault(target, None)
            await self._call(query("member_settle"), sorted(dead))
        except SessionLost:
            raise
        except Exception as exc:  # e.g. a lock_timeout: its claims still expire
            log.warning("member %r: settling member %d's death failed: %r", self._name, target, exc)
            dead = {target: None}
        unknown = sorted(i for i, why in dead.items() if why is None and i in self.ids)
        #: Dead, but their rows not marked yet: not told (see below).
        unrecorded: set[int] = set()
        if unknown:
            # Marked by someone else (another watcher's reap, a sweep, its own goodbye):
            # the row says why. Guessing "left" told a crash as a goodbye whenever our
            # own news of it had not come first.
            try:
                reasons = json.loads(await self._call(query("member_left_reasons"), unknown))
            except SessionLost:
                raise
            except Exception as exc:
                log.warning("member %r: reading why members %s left failed: %r", self._name, unknown, exc)
                unrecorded.update(unknown)
            else:
                for i, why in reasons.items():
                    if why is None:
                        unrecorded.add(int(i))
                    else:
                        dead[int(i)] = why
        # Move on past the dead at once, but only past those whose death is recorded.
        # A target whose row is not marked yet (our reap failed: another reaper holds
        # the row and marks it in a moment, or an operator holds it) is not told: it
        # used to be told as "left" before its row said anything. It stays in the ring
        # (member_ring lists it until it is marked): the next round is granted its lock
        # at once, and reaps it or finds it marked and reads why. (A row already swept,
        # a minute after it was marked, can say nothing more.)
        for member_id, reason in dead.items():
            if member_id in self.ids and member_id not in unrecorded:
                self._told_dead(member_id, reason or "left")

    async def read(self) -> set[int]:
        """Read the ring afresh (when membership news is not listened to) and move the
        watcher on if its target changed; returns the members gone from it."""
        ring = [int(i) for i in json.loads(await self._call(query("member_ring")))]
        gone = set(self.ids) - set(ring)
        self.ids = ring
        self.retarget(stands=False)  # the watcher syncs its stands next, in its new round
        return gone

    async def tell_predecessor(self) -> None:
        """A member that joined between two others: the one before us watches our
        successor, and must watch us now. It may not listen to membership news, so
        its watcher's wait is cut short, and it reads the ring afresh."""
        successor = self.successor()
        if successor is None:
            return
        try:
            await self._call(query("member_poke_predecessor"), successor)
        except SessionLost:
            raise
        except Exception as exc:  # another role's session: its heartbeat finds us
            log.info("member %r: could not wake the member before us: %r", self._name, exc)

    async def _idle(self, watcher: HolderConnection) -> None:
        # Alone: nothing to wait for. A sleep on the server, not here: the session
        # must not go idle for its idle_session_timeout (that is for a paused
        # process), and a poke or a retarget must be able to cut it short. A member
        # that joins pokes us, but its poke is lost if it lands between two of our
        # statements: so a lone member also looks at the ring every second.
        if self.fresh_ring is not None:
            await self.fresh_ring()
            if self.successor() is not None:
                return
        self._waiting = True
        try:
            await watcher.fetchval(query("member_idle"), min(self._ttl / 3, LONE_LOOK_EVERY))
        except Exception as exc:
            if _errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED:
                raise
            self._waiting = False
            await self._woken()
        finally:
            self._waiting = False

    async def _unwatch(self, watcher: HolderConnection, target: int, *, held_or_not: bool = False) -> bool:
        """Give back the share of ``target``'s alive lock; with ``held_or_not``, only if
        it was granted (True then)."""
        # A retarget's pg_cancel_backend may land on this statement: try again.
        for _ in range(5):
            try:
                if held_or_not:
                    return bool(await watcher.fetchval(query("member_unwatch_if_held"), target))
                await watcher.fetchval(query("member_unwatch"), target)
                return True
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED:
                    raise
        raise RuntimeError(f"could not give back member {target}'s alive lock")
