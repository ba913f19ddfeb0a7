"""``Partitions``: N parts of work spread over the live members that take part, each
part owned by one member at a time and fenced; see docs/partitions.md.

Each part ``"<name>/<index>"`` is a row of ``pgcoord.leases``: its fence grows on
every change of owner, so ``check_fence(conn, part.name, part.fence)`` rejects a
stale owner's writes. An owner also holds the part's doorbell (the session lock
an elector's leader holds) on its member's session, so that the moment that
session ends — the process died, was terminated, the server restarted — the row
is free for the taking, without waiting for the lease to expire.

Who owns what is computed by every participant from the same facts, read in one
statement: the live participants (members whose session holds this partitioning's
participation lock) and the current owner of each part (``_assignment.balanced``:
balanced, and sticky, so a change moves only the parts it must). Each participant
then acts on its own parts only: it gives up those assigned elsewhere, and claims
those assigned to it once they are free. A participant looks again whenever there
is news — a member gone (the member's death news), a participant joining or
leaving, a part released (lease news) — and at least every third of a ttl.

Handover: a part that must move is given up only after its ``own()`` was cancelled
and has finished, and only then can the new owner claim it and start its own.
A member that dies takes its ``own()`` calls with it; its parts are claimed as
soon as the others hear of the death.

The owner believes it owns a part only inside a trust window that closes, on the
monotonic clock, before anyone else could take the part over (the lease's expiry,
or the server ending our silent session), as ``Lease`` and ``Elector`` do. Claims
and renewals are one statement for all of a member's parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._core import errmap as _errmap
from .._core import readonly
from .._core.aio import RECANCEL_EVERY, Backoff, finish_despite_cancel
from .._core.queries import query
from ..errors import PgcoordError, SchemaMissing, UnsupportedConnection
from ..keys import lock_key
from ..leases.statements import validate_ttl
from ..leases.tenure import Tenure, close_expired, settle_batch
from ..member import SessionLost
from ..observability import metrics
from .assignment import balanced

if TYPE_CHECKING:
    from ..member import Member, MemberSession

from .parts import Own, Partition, _Held, _SessionGone, _validate

__all__ = ["Partition", "Partitions"]

log = logging.getLogger("pgcoord.partitions")

PARTS_CHANNEL = "pgcoord_partitions"
LEASE_CHANNEL = "pgcoord_leases"
# Each claim, renewal and look is one statement on the member's shared session:
# bounded so that none of them holds it long (claims also go in batches).
CLAIM_BATCH = 256
# A part held FOR SHARE by a fenced write is renewed by a statement that waits
# for that transaction at most this long (on the shared session), then again soon.
BUSY_RENEW_WAIT_MS = 100
BUSY_RENEW_AGAIN = 0.05
# An own() that raised is started again after this long, doubling to the max,
# while its part stays ours.
RESTART_FIRST = 1.0
RESTART_MAX = 30.0
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0



_running_on: weakref.WeakKeyDictionary[Member, set[str]] = weakref.WeakKeyDictionary()


class Partitions:
    """``count`` parts of ``name`` spread over the live members running ``run()``.

    ``Partitions(member, "ingest", count=64)``; ``await parts.run(own)`` calls
    ``own(part)`` for each part this member comes to own, as a task of its own,
    and cancels it when the part moves away (or its trust window closes, or the
    member's session is lost). An ``own()`` that returns keeps its part until
    the part moves; one that raises is logged and started again after a back-off
    (1 s, doubling to 30 s) while the part stays ours. ``ttl`` (default: the
    member's) is the parts' lease ttl: how long an unrenewed part stays taken.
    The name is database-wide: every member running ``Partitions`` of that name,
    whatever its group, takes part.
    """

    def __init__(self, member: Member, name: str, *, count: int, ttl: float | None = None) -> None:
        _validate(member, name, count)
        self.member = member
        self.name = name
        self.count = count
        self.ttl = validate_ttl(member.ttl if ttl is None else ttl)
        self._held: dict[int, _Held] = {}
        self._holder: str | None = None  # "<member name>/<member id>" for this session
        self._news = asyncio.Event()
        self._lost = asyncio.Event()
        self._watch = asyncio.Event()  # wakes the watchdog: a part was lost
        self._running = False
        self._renew_at = 0.0
        self._own: Own | None = None
        self._session_id: int | None = None  # the member id of the session we serve on
        self._mismatch_logged = -60.0

    # -- what users read --------------------------------------------------------------

    @property
    def owned(self) -> frozenset[int]:
        """The parts this member owns now (their trust window is open), including
        parts on their way to another member whose ``own()`` is still finishing."""
        now = time.monotonic()
        return frozenset(i for i, held in self._held.items() if now < held.trust_until)

    async def assignment(self) -> dict[int, str]:
        """Who owns each owned part now, ``{index: member name}``, read from the
        database (parts being handed over or not yet claimed are absent)."""
        await self.member.wait_joined()
        try:
            state = await self._state(self.member.session())
        except SessionLost as exc:
            raise PgcoordError(f"partitions {self.name!r}: the member has no session right now") from exc
        return {index: holder.rpartition("/")[0] for index, holder in state[1].items()}

    def _part_name(self, index: int) -> str:
        return f"{self.name}/{index}"

    def _bell(self, index: int) -> int:
        # pgcoord.lease_doorbell_key(part name), as the SQL computes it.
        return lock_key(f"pgcoord.elector:{self._part_name(index)}")

    @property
    def _window(self) -> float:
        # The earliest anyone may take a part over: its lease's expiry, or the server
        # ending our silent session (the member's idle_session_timeout, 0.9 x ttl).
        return min(self.ttl, self.member.ttl * 0.9)

    # -- news --------------------------------------------------------------------------------

    def _on_parts_news(self, payload: str) -> None:
        if payload == self.name:
            self._news.set()

    def _on_lease_news(self, payload: str) -> None:
        try:
            news = json.loads(payload)
        except ValueError:
            return
        lease = news.get("name")
        if isinstance(lease, str) and lease.startswith(self.name + "/"):
            self._news.set()

    def _on_session_lost(self, old_id: int) -> None:
        """Our session ended: every part went with it. Stop every own() now."""
        if old_id != self._session_id:
            return
        self._lost.set()
        self._news.set()
        for held in self._held.values():
            held.tenure.lose("the member's session was lost")
            self._stop_own(held)

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, own: Own) -> None:
        """Own parts until cancelled: returns only by cancellation (or raises
        ``SchemaMissing``, ``UnsupportedConnection``, or ``RuntimeError`` when the
        member is closed under it: cancel ``run()`` before closing its member). On
        the way out every ``own()`` is cancelled and awaited, however long it takes
        (the next owner must not start before it ends), then every part is given up."""
        if not callable(own):
            raise TypeError("own must be an async function taking a Partition")
        if self._running:
            raise RuntimeError(f"Partitions {self.name!r} is already running")
        names = _running_on.setdefault(self.member, set())
        if self.name in names:
            raise RuntimeError(f"another Partitions {self.name!r} already runs on this member")
        names.add(self.name)
        self._running, self._own = True, own
        member = self.member
        unhooks: list[Callable[[], None]] = []
        session: MemberSession | None = None
        watchdog: asyncio.Task[None] | None = None
        backoff = Backoff(BACKOFF_FIRST, BACKOFF_MAX)
        try:
            unhooks += [member.on_member_left(lambda _id: self._news.set()),
                        member.on_session_lost(self._on_session_lost)]
            unhooks.append(await member.listen(PARTS_CHANNEL, self._on_parts_news))
            unhooks.append(await member.listen(LEASE_CHANNEL, self._on_lease_news))
            watchdog = asyncio.create_task(self._watchdog(), name=f"pgcoord-parts-watchdog:{self.name}")
            while True:
                await self._wait_joined()
                if member.polling:
                    raise UnsupportedConnection(
                        "Partitions needs a session (an owner's death must free its parts at once); "
                        "this member is behind a transaction-mode pooler")
                try:
                    session = member.session()
                except SessionLost:  # joining again right now
                    await asyncio.sleep(0.05)
                    continue
                try:
                    await self._serve(session)
                except (SchemaMissing, UnsupportedConnection):
                    raise
                except Exception as exc:
                    mapped = _errmap.as_schema_missing(exc)
                    if isinstance(mapped, SchemaMissing):
                        raise mapped from exc
                    lost = self._lost.is_set() or isinstance(exc, SessionLost | _SessionGone)
                    await finish_despite_cancel(self._stop_tasks(), bound=None)
                    if lost:
                        self._held.clear()
                        metrics.parts_owned(self.name, 0)
                        log.info("partitions %r: the member's session was lost; parts dropped", self.name)
                        backoff.reset()
                        session = None
                        await asyncio.sleep(random.uniform(0.0, 0.02))
                        continue
                    backoff.failed()
                    delay = backoff.jittered()
                    readonly.retrying(log, exc, "partitions %r: %r; trying again in %.2fs", self.name, exc,
                                      delay)
                    await self._leave_quietly(session)
                    session = None
                    await asyncio.sleep(delay)
        finally:
            for unhook in unhooks:
                unhook()
            if watchdog is not None:
                watchdog.cancel()
                await finish_despite_cancel(asyncio.gather(watchdog, return_exceptions=True))
            try:
                # However long own() takes to finish: its part may not move before.
                await finish_despite_cancel(self._stop_tasks(), bound=None)
            finally:
                await self._shutdown(session)
                self._running = False
                names.discard(self.name)

    async def _wait_joined(self) -> None:
        """Until the member has a session; ``RuntimeError`` once it is closed."""
        while True:
            if not self.member._open:
                raise RuntimeError("the Member was closed under Partitions.run(); cancel run() first")
            try:
                await asyncio.wait_for(self.member.wait_joined(), 0.5)
                return
            except TimeoutError:
                continue

    async def _watchdog(self) -> None:
        """Stop a part's own() the moment its trust window closes, whatever the loop
        is doing (a statement on the shared session may be slow to answer)."""
        while True:
            now = time.monotonic()
            lingering = self._cancel_lost_again()
            by_tenure = {id(h.tenure): h for h in self._held.values()}
            for tenure in close_expired([h.tenure for h in by_tenure.values()], now):
                held = by_tenure[id(tenure)]
                lingering = True
                if not held.draining:
                    log.warning("partitions %r: part %d not renewed within its trust window; "
                                "stopping it", self.name, held.part.index)
                    self._drain(held)
                    self._news.set()
            upcoming = [h.trust_until for h in self._held.values() if not h.lost]
            pause = min(1.0, max(0.0, min(upcoming, default=now + 1.0) - now)) + 0.001
            self._watch.clear()
            # asyncio.wait, not wait_for: on 3.11 wait_for can swallow our own
            # cancellation when the event is set at the same moment.
            woken = asyncio.ensure_future(self._watch.wait())
            try:
                await asyncio.wait({woken}, timeout=min(pause, RECANCEL_EVERY) if lingering else pause)
            finally:
                woken.cancel()

    def _cancel_lost_again(self) -> bool:
        """Cancel again each cancelled own() still running for a lost part: the part
        may have a new owner by now, and a driver can turn a cancellation into an
        error that own() retries on. (A part given up in good order is still ours
        while its own() winds down: that one is cancelled once.) True while any
        such own() runs."""
        lingering = False
        for held in list(self._held.values()):
            task = held.task
            if held.lost and held.stopping and task is not None and not task.done():
                if not held.told:
                    held.told = True
                    log.warning("partitions %r: own(%s) went on after its cancellation; cancelling "
                                "it again until it ends", self.name, held.part.name)
                task.cancel()
                lingering = True
        return lingering

    async def _call(self, session: MemberSession, name: str, *args: Any) -> Any:
        if self._lost.is_set():
            raise _SessionGone("the member's session was lost")
        return await session.fetchval(query(name), *args)

    async def _serve(self, session: MemberSession) -> None:
        member_id = self.member.id
        if member_id is None:
            raise _SessionGone("no session")
        self._session_id = member_id
        self._lost.clear()
        if self.member.id != member_id:  # lost between the two reads
            raise _SessionGone("the member's session was lost")
        self._holder = f"{self.member.name}/{member_id}"
        await self._call(session, "partition_join", self.name, self.count, member_id)
        session.owned[(self._participation_key(member_id), False)] += 1
        self._renew_at = 0.0
        backoff = Backoff(BACKOFF_FIRST, BACKOFF_MAX)
        while True:
            self._news.clear()  # before looking, so that news arriving meanwhile is kept
            try:
                await self._step(session)
                backoff.reset()
            except Exception as exc:
                if (self._lost.is_set() or isinstance(exc, SessionLost | _SessionGone)
                        or isinstance(_errmap.as_schema_missing(exc), SchemaMissing)):
                    raise
                # A step that failed (a statement cut short by lock_timeout, say) keeps
                # what we own: the trust windows still bound how long we believe it.
                backoff.failed()
                delay = backoff.jittered()
                readonly.retrying(log, exc, "partitions %r: %r; looking again in %.2fs", self.name, exc,
                                  delay)
                await self._wait(time.monotonic() + delay)
                continue
            await self._wait(self._next_deadline())

    def _participation_key(self, member_id: int) -> int:
        return lock_key(f"pgcoord.partitions:{self.name}:{member_id}")

    async def _state(self, session: MemberSession) -> tuple[list[str], dict[int, str]]:
        state = json.loads(await session.fetchval(query("partition_state"), self.name, self.count))
        if state.get("beyond") and time.monotonic() >= self._mismatch_logged + 60.0:
            self._mismatch_logged = time.monotonic()
            log.error("partitions %r: another member runs it with more than count=%d parts (part %d is "
                      "owned); every member must use the same count, or some parts are never owned",
                      self.name, self.count, self.count)
        owners = {int(i): str(holder) for i, holder, _fence in state["owners"]}
        return [str(m) for m in state["members"]], owners

    async def _step(self, session: MemberSession) -> None:
        """Look once: drop parts whose trust ran out, give up parts assigned away
        (once their own() has finished), claim parts assigned to us, renew."""
        members, owners = await self._state(session)
        target = balanced(self.name, self.count, members, owners)
        holder = self._holder
        assert holder is not None
        for index, held in self._held.items():
            if target.get(index) != holder and not held.draining:
                self._drain(held)
        finished = [held for held in self._held.values()
                    if held.draining and (held.task is None or held.task.done())]
        if finished:
            await self._release(session, finished)
        live = set(members)
        wanted = sorted(index for index, owner in target.items()
                        if owner == holder and index not in self._held
                        and (owners.get(index) not in live or owners.get(index) == holder))
        for start in range(0, len(wanted), CLAIM_BATCH):
            await self._claim(session, wanted[start:start + CLAIM_BATCH])
        if self._held and time.monotonic() >= self._renew_at:
            await self._renew(session)

    def _drain(self, held: _Held) -> None:
        held.draining = True
        self._stop_own(held)

    @staticmethod
    def _stop_own(held: _Held) -> None:
        """Cancel a part's own(), once (a second cancel would cut its cleanup short;
        only a lost part's is cancelled again, by ``_cancel_lost_again``)."""
        held.stopping = True
        task = held.task
        if task is not None and not task.done() and not task.cancelling():
            task.cancel()

    def _next_deadline(self) -> float:
        now = time.monotonic()
        deadline = now + self._window / 3 * random.uniform(0.8, 1.0)  # look again anyway
        if self._held:
            deadline = min(deadline, self._renew_at)
            deadline = min([deadline] + [h.trust_until for h in self._held.values() if not h.draining])
        return deadline

    async def _wait(self, deadline: float) -> None:
        timeout = max(0.0, deadline - time.monotonic())
        if self._news.is_set() or timeout == 0.0:
            return
        news = asyncio.ensure_future(self._news.wait())
        try:
            await asyncio.wait({news}, timeout=timeout)
        finally:
            news.cancel()

    # -- claims, renewals, releases ------------------------------------------------------------

    async def _claim(self, session: MemberSession, wanted: list[int]) -> None:
        assert self._holder is not None and self._own is not None
        sent = time.monotonic()
        try:
            raw = await self._call(session, "partition_claim", self.name, wanted, self._holder,
                                   int(self.ttl * 1000))
        except Exception:
            # Doorbells taken before the failure are still held (session locks
            # outlive a failed statement): give back those of parts not ours.
            if not self._lost.is_set():
                with contextlib.suppress(Exception):
                    await self._call(session, "partition_unring", self.name, wanted)
            raise
        if self._lost.is_set():
            raise _SessionGone("the member's session was lost during a claim")
        taken, _given_back = json.loads(raw)
        for index, fence in taken:
            part = Partition(int(index), self._part_name(int(index)), int(fence))
            tenure = Tenure(part.name, self._window)
            tenure.taken(part.fence, sent)
            held = _Held(part, tenure)
            self._held[part.index] = held
            session.owned[(self._bell(part.index), False)] += 1
            held.task = asyncio.create_task(self._supervise(part), name=f"pgcoord-part:{part.name}")
            held.task.add_done_callback(lambda _t: self._news.set())
        if taken:
            metrics.parts_owned(self.name, len(self._held))
            log.info("partitions %r: %s claimed parts %s", self.name, self._holder,
                     sorted(int(i) for i, _f in taken))
            if self._renew_at == 0.0 or len(taken) == len(self._held):
                self._renew_at = sent + self._window / 3

    async def _renew(self, session: MemberSession) -> None:
        assert self._holder is not None
        held = [h for h in self._held.values() if time.monotonic() < h.trust_until or h.draining]
        if not held:
            return
        sent = time.monotonic()
        raw = await self._call(session, "partition_renew", self.name,
                               [h.part.index for h in held], [h.part.fence for h in held],
                               self._holder, int(self.ttl * 1000))
        renewed, ours = (set(map(int, x)) for x in json.loads(raw))
        self._renewed(held, renewed, ours, sent)
        self._renew_at = sent + self._window / 3
        busy = [h for h in held if h.part.index in ours and h.part.index not in renewed]
        if busy:
            # Held FOR SHARE by fenced writes right now: wait for the current one (briefly,
            # on the shared session) rather than skip again, or a part written to without
            # pause would never be renewed.
            sent = time.monotonic()
            try:
                raw = await self._call(session, "partition_renew_waiting", str(BUSY_RENEW_WAIT_MS), self.name,
                                       [h.part.index for h in busy], [h.part.fence for h in busy],
                                       self._holder, int(self.ttl * 1000))
            except Exception as exc:
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
                    raise
                self._renew_at = time.monotonic() + BUSY_RENEW_AGAIN
                return
            renewed, ours = (set(map(int, x)) for x in json.loads(raw))
            self._renewed(busy, renewed, ours, sent)
            if any(h.part.index in ours and h.part.index not in renewed for h in busy):
                self._renew_at = time.monotonic() + BUSY_RENEW_AGAIN

    def _renewed(self, held: list[_Held], renewed: set[int], ours: set[int], sent: float) -> None:
        if self._lost.is_set():
            raise _SessionGone("the member's session was lost during a renewal")
        by_index = {h.part.index: h for h in held}
        for index in settle_batch({i: h.tenure for i, h in by_index.items()}, sent, renewed, ours):
            h = by_index[index]
            log.warning("partitions %r: part %d (fence %d) was taken over", self.name, index, h.part.fence)
            self._drain(h)
            self._watch.set()

    async def _release(self, session: MemberSession, parts: list[_Held]) -> None:
        assert self._holder is not None
        await self._call(session, "partition_release", self.name, [h.part.index for h in parts],
                         [h.part.fence for h in parts], self._holder, [h.part.index for h in parts])
        for h in parts:
            self._held.pop(h.part.index, None)
            self._unowned(session, h.part.index)
        metrics.parts_owned(self.name, len(self._held))
        log.info("partitions %r: %s gave up parts %s", self.name, self._holder,
                 sorted(h.part.index for h in parts))

    def _unowned(self, session: MemberSession, index: int) -> None:
        key = (self._bell(index), False)
        session.owned[key] -= 1
        if session.owned[key] <= 0:
            del session.owned[key]

    # -- the parts' own() --------------------------------------------------------------------------

    async def _supervise(self, part: Partition) -> None:
        own = self._own
        assert own is not None
        backoff = Backoff(RESTART_FIRST, RESTART_MAX)
        while True:
            try:
                await own(part)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                held = self._held.get(part.index)
                if held is not None and held.stopping and held.task is asyncio.current_task():
                    # We are stopping it: the error may be our cancellation come back
                    # as one (a driver's, as the connection broke). Not restarted.
                    log.warning("partitions %r: own(%s) ended with %r while being stopped",
                                self.name, part.name, exc)
                    raise asyncio.CancelledError from exc
                log.exception("partitions %r: own(%s) failed; starting it again in %.0fs",
                              self.name, part.name, backoff.failed())
            await asyncio.sleep(backoff.delay)  # not jittered: one part, one owner

    async def _stop_tasks(self) -> None:
        """Cancel every own() (once, unless its part is lost: a second cancel would
        cut its cleanup short) and wait for each to end, however long, saying so
        every few seconds."""
        for held in self._held.values():
            self._stop_own(held)
        tasks = {h.task for h in self._held.values() if h.task is not None and not h.task.done()}
        said = time.monotonic()
        while tasks:
            _done, tasks = await asyncio.wait(tasks, timeout=RECANCEL_EVERY)
            self._cancel_lost_again()
            if tasks and time.monotonic() - said >= 5.0:
                said = time.monotonic()
                log.warning("partitions %r: waiting for %d own() calls to finish after cancellation",
                            self.name, len(tasks))

    async def _leave_quietly(self, session: MemberSession | None) -> None:
        """Give back what this session may still hold, without raising; whatever
        is left is unlocked by the member in the background (``terminate``)."""
        if session is not None and not self._lost.is_set() and self._holder is not None:
            with contextlib.suppress(Exception):
                await finish_despite_cancel(self._give_up(session))
            session.terminate()
        self._held.clear()
        metrics.parts_owned(self.name, 0)

    async def _give_up(self, session: MemberSession) -> None:
        """Give up every part this session holds, including any whose claim was cut
        short (its doorbell taken, the reply never read), and stop taking part."""
        assert self._holder is not None
        member_id = self._session_id
        await self._call(session, "partition_release_all", self.name, self.count, self._holder)
        for index in list(self._held):
            self._unowned(session, index)
        self._held.clear()
        metrics.parts_owned(self.name, 0)
        if member_id is not None:
            key = (self._participation_key(member_id), False)
            if session.owned.get(key):
                await self._call(session, "partition_leave", self.name, member_id)
                del session.owned[key]

    async def _shutdown(self, session: MemberSession | None) -> None:
        """Give every part up, bounded; whatever is left on the session is unlocked
        by the member in the background (``terminate``)."""
        try:
            if session is not None and not self._lost.is_set() and self._holder is not None:
                try:
                    await finish_despite_cancel(self._give_up(session), on_timeout=session.terminate)
                except Exception as exc:
                    log.warning("partitions %r: giving up parts failed: %r", self.name, exc)
        finally:
            if session is not None:
                session.terminate()
            self._held.clear()
            metrics.parts_owned(self.name, 0)
