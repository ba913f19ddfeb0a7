"""Leases with fencing tokens: ``Lease`` and ``check_fence``.

A lease is a row in ``pgcoord.leases``. Acquiring it bumps the row's fence;
renewing and releasing are scoped to the exact holder and fence, so nobody can
renew or release someone else's lease, and a lease that has expired in the
database is never renewed, not even by its last holder. Only the database clock
decides expiry. The holder keeps a *trust window* on its monotonic clock that
closes before the server would let anyone take over, and stops believing it
holds the lease when the window closes, also after a pause.

Every statement a ``Lease`` runs takes a connection from the user's pool for
that statement only. A connection the pool hands out dead (its session was
terminated while it sat idle, or the server restarted) is not the caller's
problem: the statement is tried again on another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._core import errmap as _errmap
from .._core import readonly
from .._core.aio import (
    CLEANUP_TIMEOUT,
    CleanupTimeout,
    Supervisor,
    absorb_cancel,
    finish_despite_cancel,
)
from .._core.checks import SECONDS_MAX
from .._core.queries import query
from .._drivers import check_source
from ..errors import LeaseLost, LockBusy, LockTimeout, PgcoordError
from ..observability import metrics
from .fence import SQLSTATE_STALE_FENCE as SQLSTATE_STALE_FENCE
from .fence import check_fence as check_fence
from .tenure import Doorbell, Renewal, Tenure, keep_renewed, trust_margin

if TYPE_CHECKING:
    from ..member import Member, MemberSession

from .statements import (
    _attempts,
    _refuse_single_connection_pool,
    _retried,
    _Statement,
    default_holder,
    lock_timeout_setting,
    validate_holder,
    validate_name,
    validate_ttl,
)

__all__ = ["Lease", "check_fence", "default_holder", "trust_margin", "validate_holder"]

#: After a member-bound lease starts standing for a busy lease, it looks again this
#: soon, in case the lease was let go of before the watcher held the candidacy lock.
STAND_SETTLES = 0.1

log = logging.getLogger("pgcoord.leases")


# How long leaving a lease may wait for its release before giving up on it (the
# lease then expires on its own). Also sent to the server as the release's
# lock_timeout, so the server stops waiting when the client does.
RELEASE_TIMEOUT = CLEANUP_TIMEOUT

# How long taking a lease may wait for its row while a fenced transaction holds it
# FOR SHARE, when the caller does not wait (wait=False): then it is busy.
BUSY_ROW_WAIT = 0.05
# How a bounded wait for a row held by a fenced transaction ends without the row: its
# own lock_timeout, or a shorter statement_timeout that pgcoord did not set.
_ROW_WAIT_CUT = (_errmap.SQLSTATE_LOCK_NOT_AVAILABLE, _errmap.SQLSTATE_QUERY_CANCELED)



# Rows taken by a take that was cancelled in flight, given back in the background.
_orphans = Supervisor("pgcoord leases", log)


class Lease:
    """A named lease with a fencing token (docs/leases.md).

    ``async with Lease(pool, "invoice-run", ttl=10) as fence:`` waits to acquire,
    renews every ``ttl/3`` in the background, and cancels the body with
    ``LeaseLost`` when a renewal fails for good or the trust window closes.

    ``source`` is a pool or an engine (asyncpg ``Pool``, psycopg
    ``AsyncConnectionPool``, SQLAlchemy ``AsyncEngine``) of at least two
    connections: renewals borrow one for a moment every ``ttl/3``, beside whatever
    the body holds. A bare connection is refused (``UnsupportedConnection``): the
    renewals would run beside the owner's own statements, or inside its
    transaction, where a rollback would undo a renewal already counted.

    Each holding is a ``Tenure`` of the tenure engine (``_tenure``): its trust
    window, its loss and its renewals are the engine's, as for an elector's term.
    """

    def __init__(
        self, source: Any, name: str, *, ttl: float, holder: str | None = None,
        member: Member | None = None,
    ) -> None:
        check_source(source, need_async=True, background="Lease")
        _refuse_single_connection_pool(source)
        self.name = validate_name(name)
        self.ttl = validate_ttl(ttl)
        self.holder = validate_holder(holder)
        self._source = source
        # With a member the lease is tied to the member's session: the doorbell of
        # the lease (as an elector's) is held on it, so once that session is gone
        # anyone may take the lease over without waiting out the ttl.
        self._member = member
        self._bell: Doorbell | None = None
        self._news = asyncio.Event()
        self._withdraw: Callable[[], None] | None = None  # standing for the lease (a member)
        self._attempts = _attempts(source)
        self._tenure: Tenure | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._body: asyncio.Task[Any] | None = None
        self._body_cancelled = False
        self._acquiring = 0  # acquire() calls under way
        metrics.warm_up()

    @property
    def fence(self) -> int | None:
        tenure = self._tenure
        return None if tenure is None else tenure.fence

    @property
    def _lost(self) -> str | None:
        tenure = self._tenure
        return None if tenure is None else tenure.lost

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl * 1000)

    @property
    def valid(self) -> bool:
        """True inside the local trust window of a held lease."""
        tenure = self._tenure
        return tenure is not None and tenure.valid

    def ensure(self) -> None:
        """Raise ``LeaseLost`` unless the lease is valid; call before an unfenced side effect."""
        if not self.valid:
            raise LeaseLost(f"lease {self.name!r} is not held: {self._lost or 'trust window closed'}")

    @property
    def _window(self) -> float:
        """The shortest time after a renewal's send before someone else may take over.
        With a member, also when the server ends the member's silent session: its
        idle timeout (0.9 of its ttl) runs from its last statement, at worst a
        heartbeat interval (a third of its ttl) before our renewal."""
        if self._member is None:
            return self.ttl
        return min(self.ttl, self._member.ttl * (0.9 - 1 / 3))

    async def _row(self, name: str, *params: Any, via: _Statement | None = None) -> tuple[Any, ...] | None:
        return await (via or _Statement(self._source)).row(query(name), params)

    async def _take(self, pid: int | None, bound: float) -> tuple[Any, ...] | None:
        """Take the row if it is free (None if not). A row held ``FOR SHARE`` by a
        fenced transaction is waited for ``bound`` seconds at most, then is busy."""
        async def once(retrying: bool) -> tuple[Any, ...] | None:
            try:
                row = await self._row("lease_acquire_bounded", self.name, self.holder, self._ttl_ms,
                                      pid, lock_timeout_setting(bound))
            except Exception as exc:
                # Past the bound (55P03), or cut sooner by a statement_timeout of the
                # server's, database's or role's (57014; pgcoord's own cancels raise
                # CancelledError): the row is busy either way, and nothing was taken.
                if _errmap.sqlstate(exc) not in _ROW_WAIT_CUT:
                    raise
                row = None
            if row is None and retrying:
                # The try that failed may have taken the lease before its connection
                # died: then the row is ours already, with the fence it was given.
                current = await self._row("lease_current_holder", self.name)
                if current is not None and current[0] == self.holder:
                    return (current[1],)
            return row

        try:
            return await _retried(f"acquiring lease {self.name!r}", self._attempts, once)
        except PgcoordError:
            raise
        except Exception as exc:
            raise PgcoordError(f"lease {self.name!r} could not be acquired: {exc!r}") from exc

    async def _take_or_undo(self, pid: int | None, bound: float) -> tuple[Any, ...] | None:
        """``_take``; cancelled meanwhile, the row it may have taken on the server is given
        back in the background, so that it does not sit held until it expires."""
        try:
            return await self._take(pid, bound)
        except asyncio.CancelledError:
            _orphans.spawn(self._release_orphan(), f"pgcoord-lease-undo:{self.name}")
            raise

    async def _release_orphan(self) -> None:
        current = await self._row("lease_current_holder", self.name)
        # Not while this Lease takes or holds it again: that row is the new holding's.
        if (current is not None and current[0] == self.holder and not self._acquiring
                and self.fence is None):
            await self._release_row(int(current[1]))

    async def acquire(self, wait: bool = True, timeout: float | None = None) -> int:  # noqa: ASYNC109 - the contract's signature
        """Take the lease (a new fence) and start renewing it; returns the fence."""
        if self.fence is not None:
            raise RuntimeError(f"lease {self.name!r} is already held by this Lease")
        if timeout is not None and (not math.isfinite(timeout) or timeout < 0
                                    or timeout > SECONDS_MAX):
            raise ValueError(f"timeout must be a finite number of seconds from 0 to "
                             f"{SECONDS_MAX:.0f}, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._acquiring += 1
        try:
            unhook = await self._hook_member()
            try:
                return await self._acquire(wait, timeout, deadline)
            finally:
                unhook()
        finally:
            self._acquiring -= 1

    async def _hook_member(self) -> Callable[[], None]:
        """While waiting with a member: wake on any member's death and on this
        lease's news, rather than only every third of a ttl. Never waits for the
        member to have a session (``listen`` registers for the next one)."""
        member = self._member
        if member is None:
            return lambda: None
        if not member._open:
            raise RuntimeError("Member is not open: use `async with Member(...)` or open()")
        unhooks = [member.on_member_left(lambda _id: self._news.set()),
                   member.on_session_lost(lambda _id: self._news.set())]

        def unhook_all() -> None:
            for unhook in unhooks:
                unhook()
            withdraw, self._withdraw = self._withdraw, None
            if withdraw is not None:
                withdraw()

        return unhook_all

    async def _member_session(self, wait: bool, limit: float | None,
                              deadline: float | None) -> MemberSession:
        """The member's session, once it has one: ``wait`` and ``timeout`` hold for
        this wait as for the lease itself (a member that is joining again cannot
        take a lease tied to it)."""
        from ..member import SessionLost

        member = self._member
        assert member is not None
        while True:
            try:
                return member.session()
            except SessionLost:
                pass
            if not wait:
                metrics.busy(self.name)
                raise LockBusy(f"lease {self.name!r} cannot be taken now: its member "
                               f"{member.name!r} has no session (it is joining again)")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise LockTimeout(f"lease {self.name!r} not acquired within {limit}s: its member "
                                  f"{member.name!r} had no session meanwhile")
            try:
                async with asyncio.timeout(left):
                    await member.wait_joined()
            except TimeoutError:
                continue

    async def _attempt(self, tenure: Tenure, wait: bool, quiet: bool, limit: float | None,
                       deadline: float | None) -> tuple[Any, ...] | None:
        """One try at the lease: the doorbell first (with a member), then the row.
        Whatever way this ends without the lease, the doorbell it rang is dropped."""
        from ..member import SessionLost

        bound = BUSY_ROW_WAIT
        if wait:  # a fenced transaction may hold the row a while: wait for it, within limits
            left = self.ttl / 3 if deadline is None else deadline - time.monotonic()
            bound = max(BUSY_ROW_WAIT, min(self.ttl / 3, left))
        if self._member is None:
            return await self._take_or_undo(None, bound)
        session = await self._member_session(wait, limit, deadline)
        # The session's end is this tenure's loss from now on: also while the row
        # is being taken, so that a row tied to a dead session is never handed out.
        def session_ended() -> None:
            tenure.lose("the member's session, which the lease is tied to, ended")

        session.on_lost(session_ended)
        bell = Doorbell(session, self.name)
        handed = False
        try:
            try:
                rang = await bell.ring()
            except SessionLost:
                tenure.lose("the member's session ended while the lease was being taken")
                return None
            # While a live session holds the bell (a holder, or a contender
            # mid-attempt) the row is asked for only when waiting is not allowed or
            # a wait went by without news: else it could be taken unbound, in a race
            # with that contender.
            if not (rang or not wait or quiet):
                return None
            row = await self._take_or_undo(bell.pid if rang else None, bound)
            if row is not None and not rang:
                try:
                    rang = await bell.bind(self.name, self.holder, int(row[0]))
                except SessionLost:
                    tenure.lose("the member's session ended while the lease was being taken")
            if row is None or tenure.lost is not None:
                if row is not None:  # tied to a session that is gone: give it back
                    await self._release_row(int(row[0]))
                return None
            if rang:
                self._bell, handed = bell, True
            return row
        finally:
            if not handed:  # not handed to the lease: let go of it, on every way out
                bell.drop()
                session.terminate()

    async def _acquire(self, wait: bool, limit: float | None, deadline: float | None) -> int:
        quiet = False
        while True:
            self._news.clear()
            tenure = Tenure(self.name, self._window)
            sent = time.monotonic()
            row = await self._attempt(tenure, wait, quiet, limit, deadline)
            if row is not None:
                tenure.taken(int(row[0]), sent)
                tenure.on_lost(self._on_lost)
                self._tenure = tenure
                self._renewer = asyncio.create_task(self._renew_loop(tenure),
                                                    name=f"pgcoord-lease:{self.name}")
                return int(row[0])
            if tenure.lost is not None:
                continue  # our session ended mid-attempt: try again on the next one
            if not wait:
                metrics.busy(self.name)
                raise LockBusy(f"lease {self.name!r} is held by another holder")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise LockTimeout(f"lease {self.name!r} not acquired within {limit}s")
            # No doorbell for a plain lease: look again after a third of a ttl (or,
            # with a member, at news of a death or of this lease, if sooner).
            pause = self.ttl / 3 if deadline is None else min(self.ttl / 3, deadline - now)
            if self._member is not None and self._withdraw is None:
                # Busy: stand for it, to be poked by the member's watcher when it is let
                # go of or its holder is found dead (no LISTEN: see ``Member.stand``).
                # Only now, not for a lease taken at the first try: standing costs the
                # watcher a round. A release before the watcher holds the candidacy
                # lock is not poked: look once more soon.
                self._withdraw = self._member.stand(self.name, self._news.set)
                settling, pause = True, min(pause, STAND_SETTLES)
            else:
                settling = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await self._news.wait()
            # Quiet: a whole third of a ttl without news (not the short look above).
            quiet = not self._news.is_set() and not settling

    # -- renewal ------------------------------------------------------------------------------

    async def _renew_loop(self, tenure: Tenure) -> None:
        """Renew every window/3 until released or lost (the engine's loop). A failure
        is only a loss when no renewal succeeds before the trust window closes: a
        lost connection, a terminated session or a server restart in between is
        tried again."""
        fence = tenure.fence
        assert fence is not None
        statement = _Statement(self._source)

        async def renew() -> tuple[Any, ...] | None:
            nonlocal statement
            statement = _Statement(self._source)

            async def once(_retrying: bool) -> tuple[Any, ...] | None:
                # Idempotent: a second renewal only moves the expiry a little further.
                return await self._row("lease_renew", self.name, self.holder, fence, self._ttl_ms,
                                       via=statement)

            return await _retried(f"renewing lease {self.name!r}", self._attempts, once)

        def starved() -> str:
            return "" if statement.lent else (
                ": the pool had no free connection for it meanwhile (does the body hold "
                "them all? a pool of one more connection than the body uses would do)")

        await keep_renewed(tenure, Renewal(renew, every=self._window / 3, retry_every=self.ttl / 10,
                                           abandon=lambda: statement.abandon(), starved=starved))

    def _on_lost(self, reason: str) -> None:
        metrics.lock_lost(self.name, reason)
        log.warning("lease %r (fence %s) lost: %s", self.name, self.fence, reason)
        if self._body is not None:
            self._body_cancelled = True
            self._body.cancel(f"pgcoord: lease {self.name!r} lost: {reason}")

    # -- release ------------------------------------------------------------------------------

    async def release(self) -> None:
        """Stop renewing and give the lease up (on the server, a no-op if it was
        taken over meanwhile).

        Bounded by ``RELEASE_TIMEOUT``: a release that cannot finish in time (the
        row is locked by a fenced transaction, the server does not answer) is
        abandoned, and the lease expires on its own at most a ttl after its last
        renewal. The caller's own outcome is never replaced by the release's.
        """
        renewer, self._renewer = self._renewer, None
        if renewer is asyncio.current_task():
            renewer = None
        tenure, self._tenure = self._tenure, None
        fence = None if tenure is None else tenure.fence
        if renewer is None and fence is None:
            return
        bound = RELEASE_TIMEOUT
        statement = _Statement(self._source)
        bell, self._bell = self._bell, None
        try:
            await finish_despite_cancel(self._give_up(renewer, bell, fence, bound, statement), bound=bound,
                                        on_timeout=statement.abandon)
        except CleanupTimeout:
            log.warning("releasing lease %r (fence %s) did not finish within %.1f s%s; gave up: "
                        "the lease will expire on its own within %.1f s of its last renewal",
                        self.name, fence, bound,
                        "" if statement.lent else " (the pool had no free connection for it)",
                        self.ttl)
        finally:
            if bell is not None:
                bell.drop()  # at once if unring() did not get to it
                bell.session.terminate()

    async def _release_row(self, fence: int, bound: float = RELEASE_TIMEOUT,
                           statement: _Statement | None = None) -> None:
        async def once(_retrying: bool) -> None:
            # Idempotent: once released, the row no longer matches holder and fence.
            # A statement_timeout shorter than the bound cuts the wait for a fenced
            # transaction (57014, no effect): ask again until the bound is spent.
            until = time.monotonic() + bound
            while True:
                try:
                    await self._row("lease_release_bounded", self.name, self.holder, fence,
                                    lock_timeout_setting(max(0.001, until - time.monotonic())),
                                    via=statement)
                    return
                except Exception as exc:
                    if (_errmap.sqlstate(exc) != _errmap.SQLSTATE_QUERY_CANCELED
                            or time.monotonic() >= until):
                        raise

        try:
            await _retried(f"releasing lease {self.name!r}", self._attempts, once)
        except Exception as exc:  # it expires on its own; never mask the caller's error
            readonly.retrying(log, exc, "releasing lease %r (fence %s) failed; it will expire on its "
                              "own within %.1f s of its last renewal: %r", self.name, fence, self.ttl, exc)

    async def _give_up(
        self, renewer: asyncio.Task[None] | None, bell: Doorbell | None, fence: int | None,
        bound: float, statement: _Statement,
    ) -> None:
        # No asyncio.timeout() here: finish_despite_cancel bounds this (see _aio).
        if renewer is not None:
            renewer.cancel()
            await asyncio.wait({renewer})  # its outcome is not ours to raise
        # The row first, then the bell, then the poke. lease_acquire takes over a row
        # whose holder's session no longer holds its doorbell: with the bell let go
        # first, a waiter that rang in between took the row from under the release,
        # which then matched nothing (no release told, the term recorded as ended
        # by that takeover). Waiters woken by the poke find both free.
        if fence is not None:
            await self._release_row(fence, bound, statement)
        if bell is not None:
            try:
                await bell.unring()
            except Exception as exc:  # the session is gone, or busy past its bound
                log.info("lease %r: letting go of its doorbell failed (%r); left to the member",
                         self.name, exc)
        if fence is not None and self._member is not None:
            # Waiters on members listen to nothing: wake them (Member.stand).
            try:
                await self._row("lease_poke", self.name, via=statement)
            except Exception as exc:
                log.info("lease %r: waking its waiters failed (%r); they look every ttl/3",
                         self.name, exc)

    async def __aenter__(self) -> int:
        fence = await self.acquire()
        self._body = asyncio.current_task()
        return fence

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._body = None
        lost, cancelled, self._body_cancelled = self._lost, self._body_cancelled, False
        await self.release()
        if lost is not None:
            # Our cancellation of the body is withdrawn whatever came of it: also when
            # a driver turned it into an error, so that the task's cancelling() count
            # is its own again.
            if cancelled:
                absorb_cancel()
            raise LeaseLost(f"lease {self.name!r} lost: {lost}") from exc
