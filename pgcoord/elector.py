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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from . import _errmap, metrics
from ._aio import CLEANUP_TIMEOUT, absorb_cancel, consume_result, finish_despite_cancel
from ._holderconn import DsnSource, HolderConnection, behind_transaction_pooler
from ._keys import lock_key
from ._queries import query
from .errors import SchemaMissing
from .leases import trust_margin, validate_holder, validate_name, validate_ttl

__all__ = ["Elector"]

log = logging.getLogger("pgcoord.elector")

Lead = Callable[[int], Coroutine[Any, Any, Any]]


class _SessionLost(Exception):
    pass


class Elector:
    """Run ``lead(fence)`` on exactly one replica at a time; see DESIGN §3."""

    def __init__(
        self, dsn: str, name: str, *, ttl: float = 10.0, holder: str | None = None,
        driver: str | None = None, application_name: str | None = None,
    ) -> None:
        if not isinstance(dsn, str):
            raise TypeError(
                "Elector takes a DSN: it needs a session of its own, never a pool's connection"
            )
        self.name = validate_name(name)
        self.ttl = validate_ttl(ttl)
        self.holder = validate_holder(holder)
        self.application_name = (application_name or f"pgcoord-elector:{name}")[:63]
        self._source = DsnSource(dsn, driver, keepalive=self.ttl)
        self._doorbell_name = f"pgcoord.elector:{name}"
        self._doorbell = lock_key(self._doorbell_name)
        self.is_leader = False
        self.fence: int | None = None
        #: True when a transaction-mode pooler forced lease-and-poll mode.
        self.polling: bool | None = None
        self._conn: HolderConnection | None = None
        self._lost: asyncio.Event | None = None
        self._run_task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        metrics.warm_up()

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl * 1000)

    @property
    def _idle_ms(self) -> int:
        # The server ends the session after this much silence. Shorter than the
        # ttl so a paused leader is replaced within one ttl; the leader speaks
        # every ttl/3, so it tolerates a stall of over half a ttl.
        return int(self.ttl * 900)

    # -- the session ---------------------------------------------------------------

    async def _connect(self) -> HolderConnection:
        conn = await self._source.open()
        try:
            await conn.prepare()
            idle = str(max(1, int(self.ttl / 2)))
            conn.backend_pid = int(await conn.fetchval(
                query("holder_setup"), self.application_name, idle, idle, str(self._ttl_ms)
            ))
            self.polling = await behind_transaction_pooler(self._source, conn)
            if self.polling:
                log.warning("elector %r: transaction-mode pooler detected; lease-and-poll mode "
                            "(takeover up to ttl + ttl/3)", self.name)
            else:
                await conn.execute(query("elector_session").format(idle_ms=self._idle_ms))
                with contextlib.suppress(Exception):  # a name for operators; best effort
                    await conn.fetchval(query("lock_names_record"), self._doorbell,
                                        self._doorbell_name)
        except BaseException:
            await finish_despite_cancel(conn.close_now())
            raise
        lost = asyncio.Event()
        conn.on_lost(lost.set)
        self._conn, self._lost = conn, lost
        return conn

    async def _drop_session(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close_now()

    async def _call(self, sql: str, *args: Any) -> Any:
        """A statement on the elector's session; ``_SessionLost`` when the session is gone."""
        conn = self._conn
        if conn is None or (self._lost is not None and self._lost.is_set()):
            raise _SessionLost("no session")
        try:
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

    # -- follower ----------------------------------------------------------------------

    async def _campaign(self) -> tuple[int, bool, float]:
        """Wait until this replica holds the lease: (fence, holds the doorbell, send time)."""
        assert self._conn is not None
        while True:
            rang = False
            if not self.polling:
                # Block on the leader's doorbell, looking at the lease at least
                # once a ttl in case a leader leads without one.
                wait = query("advisory_timeout").format(
                    fn="pg_advisory_lock", key=self._doorbell, timeout_ms=self._ttl_ms)
                try:
                    await self._call_execute(wait)
                    rang = True
                except Exception as exc:
                    if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
                        raise
                    # The leader may have gone just after the wait gave up: take
                    # the bell now if it is free, so that a lease won here is
                    # tied to this session (and a crash of ours is heard at once).
                    rang = bool(await self._call(
                        query("advisory_call").format(fn="pg_try_advisory_lock"), self._doorbell))
            sent = time.monotonic()
            fence = await self._call(query("lease_acquire"), self.name, self.holder, self._ttl_ms,
                                     self._conn.backend_pid if rang else None)
            if fence is not None:
                return int(fence), rang, sent
            if rang:  # the bell was free but someone leads without it: let it go
                await self._call(query("advisory_call").format(fn="pg_advisory_unlock"),
                                 self._doorbell)
            # After a doorbell wait that timed out, wait on it again at once: a
            # pause here would be a window in which a leader's death goes unheard.
            if self.polling or rang:
                await asyncio.sleep(self.ttl / 3 * random.uniform(0.8, 1.0))

    async def _call_execute(self, sql: str) -> None:
        conn = self._conn
        if conn is None:
            raise _SessionLost("no session")
        try:
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
        window = self.ttl if self.polling else self._idle_ms / 1000
        trust_until = sent + window - trust_margin(window)
        last_renewal, next_renewal = sent, sent + self.ttl / 3
        self.is_leader, self.fence = True, fence
        duty: asyncio.Task[Any] = asyncio.create_task(lead(fence), name=f"pgcoord-lead:{self.name}")
        metrics.leadership(self.name, True, fence)
        log.info("elector %r: %s leads with fence %d", self.name, self.holder, fence)
        assert self._lost is not None
        lost_waiter = asyncio.create_task(self._lost.wait())
        reason = "lead() returned"
        try:
            while True:
                timeout = max(0.0, min(next_renewal, trust_until) - time.monotonic())
                await asyncio.wait({duty, lost_waiter}, timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if duty.done():
                    break
                if lost_waiter.done():
                    reason = "the elector's session was lost"
                    break
                now = time.monotonic()
                if now >= trust_until:
                    reason = "no renewal succeeded within the trust window"
                    break
                if now < next_renewal:
                    continue
                attempt_sent = time.monotonic()
                attempt = asyncio.ensure_future(self._call(
                    query("lease_renew"), self.name, self.holder, fence, self._ttl_ms))
                done, _ = await asyncio.wait({attempt}, timeout=max(0.0, trust_until - attempt_sent))
                if not done:
                    attempt.cancel()
                    attempt.add_done_callback(consume_result)
                    reason = "renewal did not answer within the trust window"
                    break
                error = attempt.exception()
                if error is None and attempt.result() is None:
                    reason = "the lease expired or was taken over"
                    break
                if isinstance(error, _SessionLost | SchemaMissing):
                    reason = f"renewal failed: {error}"
                    break
                if error is not None:  # transient: retry soon while the window is open
                    log.warning("elector %r: renewal failed, retrying: %r", self.name, error)
                    next_renewal = time.monotonic() + self.ttl / 10
                    continue
                metrics.renewal(self.name, time.monotonic() - attempt_sent,
                                attempt_sent - last_renewal)
                last_renewal = attempt_sent
                trust_until = attempt_sent + window - trust_margin(window)
                next_renewal = attempt_sent + self.ttl / 3
        finally:
            # Step down first, then clean up: nobody may think we lead from here on.
            self.is_leader, self.fence = False, None
            metrics.leadership(self.name, False, None)
            lost_waiter.cancel()
            duty.cancel()
            await finish_despite_cancel(self._finish_duty(duty))
            await finish_despite_cancel(self._resign(fence, rang))
        if not duty.cancelled() and duty.exception() is None:
            log.info("elector %r: lead() returned; resigned, campaigning again", self.name)
        else:
            log.warning("elector %r: stepped down (fence %d): %s", self.name, fence, reason)
            metrics.lock_lost(self.name, reason)

    async def _finish_duty(self, duty: asyncio.Task[Any]) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await duty
            except Exception:
                log.exception("elector %r: lead() raised", self.name)

    async def _resign(self, fence: int, rang: bool) -> None:
        """Release the row first, then the doorbell, so a woken follower finds it free."""
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT):
                await self._call(query("lease_release"), self.name, self.holder, fence)
                if rang:
                    await self._call(query("advisory_call").format(fn="pg_advisory_unlock"),
                                     self._doorbell)
        except Exception as exc:
            # Closing the session releases the doorbell; the row's session is then
            # gone, so a follower may take over without waiting out the ttl.
            log.warning("elector %r: resign failed (%r); closing the session", self.name, exc)
            await self._drop_session()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, lead: Lead) -> None:
        """Campaign, lead while elected, campaign again; until ``stop()`` or cancellation."""
        if self._run_task is not None:
            raise RuntimeError("this Elector is already running")
        self._run_task = asyncio.current_task()
        self._stopping, self._stopped = False, asyncio.Event()
        backoff = 0.0
        try:
            while True:
                try:
                    if self._conn is None or (self._lost is not None and self._lost.is_set()):
                        await self._drop_session()
                        await self._connect()
                    fence, rang, sent = await self._campaign()
                    backoff = 0.0
                    await self._lead(lead, fence, rang, sent)
                    await asyncio.sleep(self.ttl / 3 * random.uniform(0.5, 1.0))
                except SchemaMissing:
                    raise
                except (_SessionLost, OSError, Exception) as exc:
                    backoff = min(max(backoff * 2, 0.05), self.ttl / 3)
                    log.warning("elector %r: %r; campaigning again in %.2fs", self.name, exc, backoff)
                    await self._drop_session()
                    await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            absorb_cancel()
        finally:
            await finish_despite_cancel(self._drop_session())
            self._run_task = None
            self._stopped.set()

    async def stop(self) -> None:
        """Resign if leading (followers take over within milliseconds) and end ``run()``."""
        task, stopped = self._run_task, self._stopped
        if task is None or stopped is None:
            return
        self._stopping = True
        task.cancel()
        await stopped.wait()

    async def leader(self) -> str | None:
        """The current leader's holder name, or None (asked on a short connection of its own)."""
        conn = await self._source.open()
        try:
            with _errmap.schema_missing_raised():
                await conn.prepare()
                return await conn.fetchval(query("lease_current_holder"), self.name)  # type: ignore[no-any-return]
        finally:
            await conn.give_back()



