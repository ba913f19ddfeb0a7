"""``Elector``: leader election on a lease row, with a session lock as the doorbell.

The lease row in ``pgcoord.leases`` is the truth: it says who leads and with
which fence. The leader also holds a session advisory lock (the *doorbell*) on
its own dedicated session. Followers block on that lock, so when the leader's
process dies the server drops its session, releases the lock, and a follower
wakes within milliseconds and takes the lease over (the row records the
leader's pid; a lease whose session no longer holds the doorbell may be taken
at once, without waiting out the ttl).

A leader that goes silent — paused, partitioned, its event loop stuck — is ended
by the server itself: ``idle_session_timeout`` is set on the elector's session,
so after one ttl of silence the session is closed, the doorbell rings, and the
lease may be taken over. The leader's own trust window (monotonic clock) closes
before that, so it has stopped believing it leads by then.

Behind a transaction-mode pooler there are no sessions to speak of: the
elector falls back to lease-and-poll, and takeover takes up to ttl + ttl/3.

Given a ``Member`` instead of a DSN, the elector uses the member's session and
opens no connection of its own: the leader takes the doorbell with a try (never
a blocking wait, which would stall the shared session), and followers wait for
news instead of on the lock: a member's death (``MemberLeft``, at once), the
lease being released or taken (NOTIFY from the lease table's trigger), or at
the latest a third of a ttl. Any number of electors then cost no connection
beyond the member's two.

Every lease change is told on the ``pgcoord_leases`` channel to whoever listens;
``watch()`` yields each change of leader, and ``request_resign()`` asks a leader,
from anywhere, to step down gracefully (it hears at once, or at its next renewal).
An elector listens only while it leads (for resign requests) or is watched: a
listening session is signalled by every NOTIFY in the database (docs/members.md).
A follower on its own session needs no news: the doorbell wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from .._core import errmap as _errmap
from .._core import readonly
from .._core.aio import (
    CLEANUP_TIMEOUT,
    END_OF_STREAM,
    Backoff,
    CleanupTimeout,
    Subscription,
    Supervisor,
    absorb_cancel,
    cancel_until_done,
    finish_despite_cancel,
    keep_cancelling,
)
from .._core.checks import KEEPALIVE_MAX
from .._core.queries import query
from .._drivers.dedicated import DsnSource, HolderConnection, behind_transaction_pooler
from .._drivers.listen import listen, unlisten
from .._drivers.protocol import Unlisten
from ..errors import PgcoordError, SchemaMissing
from ..keys import lock_key
from ..leases.statements import lock_timeout_setting, validate_holder, validate_name, validate_ttl
from ..leases.tenure import Doorbell, Renewal, Tenure, renew_once
from ..observability import metrics

if TYPE_CHECKING:
    from ..member import Member

from .campaign import _SessionLost, campaign
from .resign import LeaderChanged, request_resign

__all__ = ["Elector", "LeaderChanged", "request_resign"]

LEASE_CHANNEL = "pgcoord_leases"

log = logging.getLogger("pgcoord.elector")

Lead = Callable[[int], Coroutine[Any, Any, Any]]

# How long stepping down may take. A resign past its bound (the lease row is
# locked by a fenced transaction, the server does not answer) is abandoned and
# the session closed instead, which frees the doorbell and lets a follower take
# the lease without waiting out the ttl. Also the release's server-side lock_timeout.
RESIGN_TIMEOUT = CLEANUP_TIMEOUT

# How long a cancelled lead() may take to finish before the elector resigns
# without it. This replica then leads again only once that lead() has ended.
LEAD_EXIT_TIMEOUT = CLEANUP_TIMEOUT





class Elector:
    """Run ``lead(fence)`` on exactly one replica at a time; see docs/leases.md."""

    def __init__(
        self, dsn: str | Member, name: str, *, ttl: float = 10.0, holder: str | None = None,
        driver: str | None = None, application_name: str | None = None,
    ) -> None:
        from ..member import Member

        self._member: Member | None = None
        if isinstance(dsn, Member):
            if driver is not None or application_name is not None:
                raise ValueError("driver= and application_name= belong to the Member, not its electors")
            self._member = dsn
        elif not isinstance(dsn, str):
            raise TypeError(
                "Elector takes a DSN or a Member: it needs a session of its own (or its member's), "
                "never a pool's connection"
            )
        self.name = validate_name(name)
        self.ttl = validate_ttl(ttl)
        self.holder = validate_holder(holder if holder is not None or self._member is None
                                      else f"{self._member.name}/{name}")
        self.application_name = (application_name or f"pgcoord-elector:{name}")[:63]
        # The session's keepalive (tcp_user_timeout) has a bound that a ttl need not.
        self._source = (DsnSource(dsn, driver, keepalive=min(self.ttl, KEEPALIVE_MAX))
                        if isinstance(dsn, str) else None)
        self._doorbell_name = f"pgcoord.elector:{name}"
        self._doorbell = lock_key(self._doorbell_name)
        self._leading = False
        self._fence: int | None = None
        self._tenure: Tenure | None = None  # the current (or last) term
        self._bell: Doorbell | None = None  # the doorbell on the current session
        # A lead() that outlived its cancellation: no new term until it ends.
        self._straggler: asyncio.Task[Any] | None = None
        self._listening = False  # on a member: listening for lease news (a watch())
        # On its own session: how to stop the LISTEN in place, if any (while leading
        # or watched), and whether the session waits on the doorbell right now.
        self._heard: Unlisten | None = None
        self._ringing = False
        self._closing = Supervisor(f"elector {name!r}", log)  # sessions cut, closing
        #: True when a transaction-mode pooler forced lease-and-poll mode.
        self.polling: bool | None = None
        self._conn: HolderConnection | None = None
        # One statement at a time on the session: a renewal left in flight by a
        # cancellation (renew_once lets it finish) is waited for by the resign that
        # follows, rather than met by the driver's "another operation is in progress".
        # A new lock with each session: one cut under a statement frees its lock.
        self._io = asyncio.Lock()
        self._lost: asyncio.Event | None = None
        self._run_task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._stop_pending = False  # stop() came before run(): the next run() returns
        self._stopped: asyncio.Event | None = None
        # Lease news: set when something a follower waits for may have happened.
        self._news = asyncio.Event()
        self._resign_asked: int | None = None  # the fence a resign was asked for
        self._duty: asyncio.Task[Any] | None = None  # the running lead(), if any
        self._unhooks: list[Callable[[], None]] = []
        self._watchers: set[asyncio.Queue[LeaderChanged]] = set()
        metrics.warm_up()

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl * 1000)

    @property
    def is_leader(self) -> bool:
        """True while this replica leads: it won the lease, its session is alive and
        its trust window is open. Read on the monotonic clock at each access, so after
        a pause past the window it reads False at once, before the loop has run."""
        tenure = self._tenure
        return (self._leading and tenure is not None and tenure.trust.is_open()
                and not (self._lost is not None and self._lost.is_set()))

    @property
    def fence(self) -> int | None:
        """The fence of the current term while ``is_leader``, else None."""
        return self._fence if self.is_leader else None

    @property
    def healthy(self) -> bool:
        """False while this replica's ``lead()`` still runs though its trust window
        has closed (it is being stopped): for readiness probes. True otherwise."""
        duty = self._duty
        return self.is_leader or duty is None or duty.done()

    def watch(self) -> LeaderWatch:
        """Each change of leader from now on, as ``LeaderChanged(holder, fence)``,
        while ``run()`` runs (it listens on the elector's or the member's session;
        behind a pooler nothing is heard). Subscribes at once. On a member, the
        elector listens only while it is watched: the first ``watch()`` of a running
        elector starts listening, and hears changes from a round trip later."""
        subscription: Subscription[LeaderChanged] = Subscription(self._watchers)
        if self._member is not None and self._unhooks and not self._listening:
            self._closing.spawn(self._listen_on_member(), f"pgcoord-elector-listen:{self.name}")
        elif self._member is None and self._heard is None and self._ringing:
            # A follower waiting on the doorbell listens to nothing: interrupt the
            # wait, so that it LISTENs before waiting again.
            self._closing.spawn(self._interrupt_wait(), f"pgcoord-elector-watch:{self.name}",
                                collected=True)
        return subscription

    async def _interrupt_wait(self) -> None:
        conn, source = self._conn, self._source
        if conn is None or source is None:
            return
        other = await source.open()
        try:
            # The wait may not have reached the server yet: ask until it is cut (the
            # follower then LISTENs before waiting again) or no longer waits.
            while self._ringing and self._heard is None and conn is self._conn:
                if await other.fetchval(query("elector_interrupt_wait"), conn.backend_pid):
                    break
                await asyncio.sleep(0.02)
        finally:
            await other.give_back()

    async def _tune_news(self, *, leading: bool) -> None:
        """On its own session: LISTEN while leading or watched, else not (a listening
        session costs every NOTIFY in the database a signal). Registered first, so
        that the lease table's trigger tells at all (``pgcoord.notify_heard``)."""
        conn = self._conn
        if self._member is not None or conn is None or self.polling:
            return
        want = leading or bool(self._watchers)
        # Under the session's statement lock, as _call: a resign tunes while a
        # renewal may still be on the wire.
        async with self._io:
            if want and self._heard is None:
                self._heard = await listen(conn, LEASE_CHANNEL, self._on_lease_news)
            elif not want and self._heard is not None:
                heard, self._heard = self._heard, None
                await unlisten(conn, LEASE_CHANNEL, heard)

    async def _listen_on_member(self) -> None:
        member = self._member
        if member is None or self._listening or not self._unhooks:
            return
        self._listening = True
        try:
            self._unhooks.append(await member.listen(LEASE_CHANNEL, self._on_lease_news))
        except BaseException:
            self._listening = False
            raise

    def _on_lease_news(self, payload: str) -> None:
        try:
            news = json.loads(payload)
        except ValueError:
            return
        if news.get("name") != self.name:
            return
        self._news.set()
        fence = int(news.get("fence") or 0)
        if news.get("ev") == "resign":
            if self._leading and self._fence == fence:
                self._resign_asked = fence
            return
        change = LeaderChanged(news.get("holder"), fence)
        for queue in self._watchers:
            queue.put_nowait(change)

    @property
    def _idle_ms(self) -> int:
        # The server ends the session after this much silence. Shorter than the
        # ttl so a paused leader is replaced within one ttl; the leader speaks
        # every ttl/3, so it tolerates a stall of over half a ttl.
        return int(self.ttl * 900)

    # -- the session ---------------------------------------------------------------

    async def _connect(self) -> HolderConnection:
        if self._member is not None:
            return await self._use_member(self._member)
        assert self._source is not None
        conn = await self._source.open()
        try:
            await conn.prepare()
            conn.backend_pid = int(await conn.fetchval(query("holder_backend_pid")))
            self.polling = await behind_transaction_pooler(self._source, conn)
            if self.polling:
                # No session settings: behind a transaction-mode pooler they would stay
                # on a server session that other clients get next.
                log.warning("elector %r: transaction-mode pooler detected; lease-and-poll mode "
                            "(takeover up to ttl + ttl/3)", self.name)
            else:
                idle = str(max(1, int(self.ttl / 2)))
                await conn.fetchval(query("holder_setup"), self.application_name, idle, idle,
                                    str(self._ttl_ms))
                await conn.execute(query("elector_session").format(idle_ms=self._idle_ms))
                with contextlib.suppress(Exception):  # a name for operators; best effort
                    await conn.fetchval(query("lock_names_record"), self._doorbell,
                                        self._doorbell_name)
        except BaseException:
            await finish_despite_cancel(conn.close_now())
            raise
        lost = asyncio.Event()
        conn.on_lost(lost.set)
        self._conn, self._lost, self._io = conn, lost, asyncio.Lock()
        self._bell = Doorbell(conn, self.name, call=self._call)
        return conn

    async def _use_member(self, member: Member) -> HolderConnection:
        """The member's session as ours; hooks for the news followers wait for."""
        await member.wait_joined()
        self.polling = member.polling
        if not self._unhooks:
            # Woken by a poke of the member's watcher (the leader let go or died, a
            # resign was asked): no LISTEN, which would tax every NOTIFY in the
            # database. Only a watch() of the leader's changes listens.
            self._unhooks = [member.stand(self.name, self._news.set)]
            if self._watchers:
                await self._listen_on_member()
        conn = member.session()
        lost = asyncio.Event()
        conn.on_lost(lost.set)
        self._conn, self._lost, self._io = conn, lost, asyncio.Lock()
        self._bell = Doorbell(conn, self.name, call=self._call)
        return conn

    def _unhook(self) -> None:
        self._listening = False
        unhooks, self._unhooks = self._unhooks, []
        for unhook in unhooks:
            unhook()

    async def _drop_session(self) -> None:
        conn, self._conn = self._conn, None
        self._heard = None  # the LISTEN and its register go with the session
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close_now()

    def _abandon_session(self) -> None:
        """For a statement given up while in flight (a cleanup past its bound, a
        renewal past the trust window), after its task was cancelled: never blocks.
        The connection is cut at once (``abort``: the server ends the session, which
        releases the doorbell, and the cancelled statement ends without a cancel
        request over a network that may not answer); the session counts as lost,
        and what is left of closing it runs in a task of its own."""
        if self._lost is not None:
            self._lost.set()
        conn, self._conn = self._conn, None
        self._heard = None
        if conn is not None:
            conn.abort()
            self._closing.spawn(conn.close_now(), f"pgcoord-elector-close:{self.name}", collected=True)

    async def _call(self, sql: str, *args: Any) -> Any:
        """A statement on the elector's session; ``_SessionLost`` when the session is gone."""
        conn, io = self._conn, self._io
        if conn is None or (self._lost is not None and self._lost.is_set()):
            raise _SessionLost("no session")
        try:
            async with io:
                return await conn.fetchval(sql, *args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            mapped = _errmap.as_schema_missing(exc)
            if isinstance(mapped, SchemaMissing):
                raise mapped from exc
            if _errmap.session_gone(exc):
                raise _SessionLost(repr(exc)) from exc
            raise

    # -- follower: see campaign.py

    async def _campaign(self) -> tuple[int, bool, float]:
        return await campaign(self)

    async def _call_execute(self, sql: str) -> None:
        conn, io = self._conn, self._io
        if conn is None:
            raise _SessionLost("no session")
        try:
            async with io:
                await conn.execute(sql)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if _errmap.session_gone(exc):
                raise _SessionLost(repr(exc)) from exc
            raise

    # -- leader ----------------------------------------------------------------------------

    async def _lead(self, lead: Lead, fence: int, rang: bool, sent: float) -> None:
        # The earliest anyone may take over: when the server ends our silent
        # session (idle_session_timeout), which comes before the lease's expiry.
        if self.polling:
            window = self.ttl
        elif self._member is not None:
            window = min(self.ttl, self._member.ttl * 0.9)  # the member's idle_session_timeout
        else:
            window = self._idle_ms / 1000
        self._resign_asked = None
        tenure = Tenure(self.name, window)
        tenure.taken(fence, sent)
        # A resign request is heard at once while leading (or at the next renewal,
        # which also says so: so a LISTEN that failed costs nothing else). Before
        # lead() starts, so that nothing else uses the session meanwhile; bounded by
        # the trust window, as a renewal is: a session that cannot answer by then is
        # cut, and the loop below steps down at once.
        await self._listen_while_leading(tenure.trust.until)
        every = min(self.ttl, window) / 3  # renew well inside the trust window
        next_renewal = sent + every
        self._tenure, self._fence, self._leading = tenure, fence, True
        duty: asyncio.Task[Any] = asyncio.create_task(lead(fence), name=f"pgcoord-lead:{self.name}")
        self._duty = duty
        metrics.leadership(self.name, True, fence)
        log.info("elector %r: %s leads with fence %d", self.name, self.holder, fence)
        assert self._lost is not None
        lost_waiter = asyncio.create_task(self._lost.wait())
        reason = "lead() returned"

        async def renew() -> Any:
            return await self._call(query("lease_renew_resign"), self.name, self.holder, fence, self._ttl_ms)

        renewal = Renewal(renew, every=every, retry_every=self.ttl / 10, abandon=self._abandon_session,
                          fatal=lambda error: isinstance(error, _SessionLost | SchemaMissing))
        try:
            while True:
                timeout = max(0.0, min(next_renewal, tenure.trust.until) - time.monotonic())
                news = asyncio.ensure_future(self._news.wait())
                try:
                    await asyncio.wait({duty, lost_waiter, news}, timeout=timeout,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    news.cancel()
                woken = self._news.is_set()
                self._news.clear()
                if duty.done():
                    break
                if lost_waiter.done():
                    reason = "the elector's session was lost"
                    break
                if self._resign_asked == fence:
                    reason = "a resign was requested"
                    break
                if not tenure.trust.is_open():
                    reason = "no renewal succeeded within the trust window"
                    break
                # On a member, news is a poke: maybe a resign was asked, which only
                # the renewal tells. Renew now.
                poked = self._member is not None and woken
                if time.monotonic() < next_renewal and not poked:
                    continue
                # A session that cannot renew in time is of no more use: cut it
                # (abandon) rather than wait for the cancelled statement.
                next_renewal, asked = await renew_once(tenure, renewal)
                if tenure.lost is not None:
                    reason = tenure.lost
                    break
                if asked:
                    self._resign_asked = fence  # renewed, and asked to step down
                    reason = "a resign was requested"
                    break
        except BaseException:
            reason = ""  # stop() or cancellation: not a loss
            raise
        finally:
            # Step down first, then clean up: nobody may think we lead from here on.
            self._leading, self._fence = False, None
            metrics.leadership(self.name, False, None)
            lost_waiter.cancel()
            # Said now, not after lead() has ended: that may take a while, and the
            # reason is what an operator looks for at this moment.
            self._say_why(reason, duty, fence)
            # After a loss another replica may lead at any moment: lead() must end
            # now, and is cancelled again until it does. Stepping down of our own
            # accord, the lease is still ours until the trust window closes (and is
            # released once lead() has ended, or at the bound): its cleanup has until
            # the sooner of the two, halfway to the bound, before it is cancelled
            # again; at once if the session is lost meanwhile.
            graceful = reason in ("", "a resign was requested", "lead() returned")
            lost = self._lost
            calm_until = min(tenure.trust.until, time.monotonic() + LEAD_EXIT_TIMEOUT / 2)

            def insist_from() -> float:
                return calm_until if graceful and not lost.is_set() else 0.0

            try:
                await self._end_duty(duty, insist_from)
            finally:
                await self._resign_bounded(fence, rang)

    async def _listen_while_leading(self, until: float) -> None:
        tuning = asyncio.ensure_future(self._tune_news(leading=True))
        lost = self._lost
        lost_waiter = asyncio.ensure_future(lost.wait()) if lost is not None else None
        try:
            await asyncio.wait({tuning} | ({lost_waiter} if lost_waiter else set()),
                               timeout=max(0.0, until - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            tuning.cancel()
            raise
        finally:
            if lost_waiter is not None:
                lost_waiter.cancel()
        if not tuning.done():
            # Past the trust window, or the session is gone: the loop steps down.
            tuning.cancel()
            self._abandon_session()
            await asyncio.wait({tuning}, timeout=CLEANUP_TIMEOUT)  # its connection is cut
        elif not tuning.cancelled() and (error := tuning.exception()) is not None:
            log.info("elector %r: listening for resign requests failed: %r", self.name, error)

    def _say_why(self, reason: str, duty: asyncio.Task[Any], fence: int) -> None:
        if not reason:
            return
        if reason == "a resign was requested":
            log.info("elector %r: resigning on request (fence %d), then campaigning again",
                     self.name, fence)
        elif duty.done() and not duty.cancelled() and duty.exception() is None:
            log.info("elector %r: lead() returned; resigning, then campaigning again", self.name)
        else:
            if duty.done() and not duty.cancelled():
                reason = "lead() raised"  # logged with its traceback once it is collected
            log.warning("elector %r: stepping down (fence %d): %s", self.name, fence, reason)
            metrics.lock_lost(self.name, reason)

    async def _finish_duty(self, duty: asyncio.Task[Any], insist_from: Callable[[], float]) -> None:
        again = await cancel_until_done(duty, insist_from=insist_from)
        if again:
            log.warning("elector %r: lead() went on after its cancellation (a driver or an "
                        "except clause took it for an error); cancelled %d more time(s)",
                        self.name, again)
        if not duty.cancelled() and (error := duty.exception()) is not None:
            log.error("elector %r: lead() raised", self.name, exc_info=error)

    async def _end_duty(self, duty: asyncio.Task[Any], insist_from: Callable[[], float]) -> None:
        try:
            await finish_despite_cancel(self._finish_duty(duty, insist_from), bound=LEAD_EXIT_TIMEOUT)
        except CleanupTimeout:
            log.error("elector %r: lead() did not finish within %.1f s of its cancellation; "
                      "resigning without it (its fence is stale; this replica leads again only "
                      "after it ends)", self.name, LEAD_EXIT_TIMEOUT)
            self._straggler = duty
            keep_cancelling(duty)  # also while resigning, and after stop()

    async def _resign_bounded(self, fence: int, rang: bool) -> None:
        bound = RESIGN_TIMEOUT
        try:
            await finish_despite_cancel(self._resign(fence, rang, bound), bound=bound,
                                        on_timeout=self._abandon_session)
        except CleanupTimeout:
            log.warning("elector %r: resigning (fence %d) did not finish within %.1f s; closed "
                        "the session instead: a follower may take the lease over as soon as "
                        "the row is free", self.name, fence, bound)

    async def _resign(self, fence: int, rang: bool, bound: float) -> None:
        """Release the row first, then the doorbell, so that nobody can take the row
        from under the release: lease_acquire takes over a row whose holder's session
        no longer holds its doorbell, and with the bell let go first (as on a member's
        session it was) a follower that rang in between took the row over, the
        release matched nothing, and the release was told to no watcher (a watch()
        saw the new leader only). A follower woken by the release's NOTIFY that finds
        the bell still held is woken again by the poke, which comes after both (we no
        longer lead either way: nobody may think so from here on)."""
        # No asyncio.timeout() here: finish_despite_cancel bounds this (see _aio).
        on_member = self._member is not None
        bell = self._bell
        try:
            if not on_member and not self._watchers:
                # Our own release is news to nobody here: stop listening first, so
                # that the release is not told to this session alone.
                await self._tune_news(leading=False)
            # On a member's shared session no wait may be long (see member_session).
            wait = bound if self._member is None else min(bound, 0.5)
            await self._call(query("lease_release_bounded"), self.name, self.holder, fence,
                             lock_timeout_setting(wait))
            if rang and bell is not None:
                await bell.unring()
            if on_member:
                await self._poke_candidates()
        except Exception as exc:
            # Closing the session releases the doorbell; the row's session is then
            # gone, so a follower may take over without waiting out the ttl. On a
            # member's session, letting go unlocks the doorbell instead.
            log.warning("elector %r: resign failed (%r); closing the session", self.name, exc)
            await self._drop_session()

    async def _poke_candidates(self) -> None:
        """Wake the followers on members now that the lease is free (they listen to
        nothing: see ``Member.stand``). Best effort: they also look every ttl/3."""
        try:
            await self._call(query("lease_poke"), self.name)
        except _SessionLost:
            raise
        except Exception as exc:
            log.info("elector %r: waking the followers failed: %r", self.name, exc)

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, lead: Lead) -> None:
        """Campaign, lead while elected, campaign again; until ``stop()`` or cancellation."""
        if self._run_task is not None:
            raise RuntimeError("this Elector is already running")
        if self._stop_pending:  # a shutdown before the start: it holds
            self._stop_pending = False
            self._end_watches()  # as at the end of any run
            return
        self._run_task = asyncio.current_task()
        self._stopping, self._stopped = False, asyncio.Event()
        metrics.campaigning(self.name)
        backoff = Backoff(first=0.05, cap=self.ttl / 3)
        try:
            while True:
                # Whatever fails here (a lost session, a server restart or outage, a
                # cleanup abandoned at its bound) is met by backing off and
                # campaigning again; only stop(), cancellation or a missing schema
                # end run().
                try:
                    await self._await_straggler()
                    if self._conn is None or (self._lost is not None and self._lost.is_set()):
                        await self._drop_session()
                        await self._connect()
                    fence, rang, sent = await self._campaign()
                    readonly.writable(f"elector:{id(self)}")  # its failures go unkeyed: see readonly
                    backoff.reset()
                    await self._lead(lead, fence, rang, sent)
                    # After a term (a resign on request above all) let another
                    # replica take over before campaigning again.
                    await asyncio.sleep(self.ttl / 3 * random.uniform(0.5, 1.0))
                except SchemaMissing:
                    raise
                except Exception as exc:
                    delay = backoff.failed()
                    readonly.retrying(log, exc, "elector %r: %r; campaigning again in %.2fs",
                                      self.name, exc, delay)
                    await self._drop_session()
                    await backoff.sleep()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            absorb_cancel()
        finally:
            with contextlib.suppress(CleanupTimeout):
                await finish_despite_cancel(self._drop_session())
            self._unhook()
            self._run_task = None
            self._stopped.set()
            self._end_watches()

    def _end_watches(self) -> None:
        for queue in self._watchers:
            queue.put_nowait(END_OF_STREAM)

    async def _await_straggler(self) -> None:
        """Wait for a lead() left behind at its bound (``keep_cancelling`` cancels it)."""
        duty = self._straggler
        while duty is not None and not duty.done():
            log.warning("elector %r: the previous lead() has not finished; not campaigning "
                        "until it does", self.name)
            await asyncio.wait({duty}, timeout=self.ttl)
        if duty is not None and not duty.cancelled() and (error := duty.exception()) is not None:
            log.error("elector %r: the previous lead() raised", self.name, exc_info=error)
        self._straggler = None

    async def stop(self) -> None:
        """Resign if leading (followers take over within milliseconds) and end ``run()``.
        Called before ``run()`` has started (a task made to run it has not had a turn
        yet), it holds: the next ``run()`` returns at once."""
        task, stopped = self._run_task, self._stopped
        if task is None or stopped is None:
            self._stop_pending = True
            return
        self._stopping = True
        task.cancel()
        await stopped.wait()

    async def leader(self) -> str | None:
        """The current leader's holder name, or None (asked on a short connection of
        its own, or on the member's session)."""
        if self._member is not None:
            await self._member.wait_joined()
            with _errmap.schema_missing_raised():
                return await self._member._call(query("lease_current_holder"), self.name)  # type: ignore[no-any-return]
        assert self._source is not None
        try:
            conn = await self._source.open()
            try:
                with _errmap.schema_missing_raised():
                    await conn.prepare()
                    return await conn.fetchval(query("lease_current_holder"), self.name)  # type: ignore[no-any-return]
            finally:
                await conn.give_back()
        except PgcoordError:
            raise
        except Exception as exc:
            raise PgcoordError(f"elector {self.name!r}: could not ask who leads: {exc!r}") from exc


#: An async iterator of ``LeaderChanged``; see ``Elector.watch``.
LeaderWatch = Subscription[LeaderChanged]
