"""Running one claimed slot: the job's body beside the heartbeat that keeps its
claim, its timeout, and the record of how it ended.

A running slot's claim is a lease: its runner heartbeats it every claim_ttl/3,
and believes it holds the claim only inside a trust window that closes (on the
monotonic clock) before the database would let anyone take the slot over, as
``Lease`` does. When the window closes — renewals failing or blocked, the slot
taken over, the process paused — the run is cancelled and records nothing. A
superseded runner can no longer record a result; in transactional mode its
writes roll back with it. A run past its schedule's ``timeout`` is cancelled and
recorded failed, reason ``timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

from .._core.aio import (
    CLEANUP_TIMEOUT,
    CleanupTimeout,
    cancel_until_done,
    consume_result,
    finish_despite_cancel,
    keep_cancelling,
)
from .._core.queries import query
from .._drivers import run_statement
from ..keys import lock_key
from ..leases.tenure import trusted_until
from ..locks.advisory import exclusive
from ..observability import metrics
from .cron import Job
from .finisher import Finisher

log = logging.getLogger("pgcoord.scheduler")

UTC = dt.UTC


def as_utc(value: dt.datetime) -> dt.datetime:
    """A timestamptz as the driver gave it (psycopg: in the session's TimeZone), in UTC."""
    return value.astimezone(UTC)


@dataclass(frozen=True)
class Slot:
    """One scheduled run: ``job`` at instant ``at`` (aware, UTC)."""

    job: str
    at: dt.datetime
    attempt: int
    manual: bool = False
    #: A connection in the run's transaction (``transactional=True`` jobs only).
    conn: Any = None
    #: The schedule's JSON arguments (``add(..., args=...)``); ``{}`` for none.
    args: Any = None

    def __post_init__(self) -> None:
        if self.at.tzinfo is None or self.at.utcoffset() is None:
            raise ValueError(f"Slot.at must be an aware datetime, got {self.at!r}")
        if self.at.tzinfo is not UTC:
            object.__setattr__(self, "at", as_utc(self.at))

    @property
    def key(self) -> str:
        """A stable idempotency key for this slot, unique per run (a retry of the slot
        keeps it): ``nightly@2026-11-29T02:00:00Z``, with the microseconds when the
        instant has any (a manual run: ``nightly@2026-11-29T02:00:00.123456Z``)."""
        stamp = self.at.strftime("%Y-%m-%dT%H:%M:%S")
        if self.at.microsecond:
            stamp += f".{self.at.microsecond:06d}"
        return f"{self.job}@{stamp}Z"



class Claim:
    """What this runner believes about its claim on a running slot: a lease whose
    trust window closes before the database lets another replica take over."""

    def __init__(self, ttl: float, sent_at: float) -> None:
        self.ttl = ttl
        self.lost: str | None = None
        self.renewed(sent_at)

    def renewed(self, sent_at: float) -> None:
        """A claim or heartbeat sent at ``sent_at`` (monotonic) succeeded. Once the
        claim is lost, a heartbeat that was in flight changes nothing."""
        if self.lost is not None:
            return
        self.sent_at = sent_at
        self.trust_until = trusted_until(sent_at, self.ttl)


@dataclass(eq=False)
class Run:
    spec: Job
    slot: Slot
    claim: Claim
    #: The runner name the slot was claimed under (with a member, it names the
    #: member's incarnation, which may have changed since).
    runner: str
    task: asyncio.Task[None] | None = None
    body: asyncio.Task[Any] | None = None
    started: bool = False


class SlotRunner:
    """The part of ``Scheduler`` that runs claimed slots (a base class, so that
    the loop and the runs stay in modules of their own)."""

    _source: Any
    _running: dict[tuple[str, dt.datetime], Run]
    _stopping: bool
    _tx_turns: asyncio.Semaphore | None
    _finisher: Finisher
    _wake: asyncio.Event

    def _start(self, spec: Job, slot: Slot, sent: float, runner: str) -> None:
        run = Run(spec, slot, Claim(spec.claim_ttl, sent), runner)
        run.task = asyncio.create_task(self._execute(run), name=f"pgcoord-job:{slot.key}")
        self._running[(spec.name, slot.at)] = run
        run.task.add_done_callback(lambda _: self._finished(run))

    def _finished(self, run: Run) -> None:
        key = (run.spec.name, run.slot.at)
        if self._running.get(key) is run:
            del self._running[key]
        self._wake.set()  # a waiting backlog may go on at once

    async def _execute(self, run: Run) -> None:
        """Run a claimed slot: its body in a task of its own, beside the heartbeat
        that keeps the claim (and cancels the body when the claim is lost); then
        record the outcome. A cancellation of this task stops the body, records
        the slot stopped and is raised again."""
        run.started = True
        slot = run.slot
        began = time.monotonic()
        metrics.slot_started(run.spec.name, slot.at.isoformat(), slot.attempt, run.runner)
        body = run.body = asyncio.create_task(self._body(run), name=f"pgcoord-job-body:{slot.key}")
        heartbeat = asyncio.create_task(self._heartbeat(run, body), name=f"pgcoord-job-claim:{slot.key}")
        cancelled = False
        try:
            try:
                await asyncio.wait({body})
            except asyncio.CancelledError:
                cancelled = True
                # The body's own cleanup (a rollback) runs first, while the claim is
                # still ours: it is cancelled again from the sooner of the claim's
                # window closing and halfway to the stop's bound (at once if the
                # claim is lost), so that it has ended before the heartbeat stops.
                calm_until = time.monotonic() + CLEANUP_TIMEOUT / 2
                await cancel_until_done(body, insist_from=lambda: min(run.claim.trust_until, calm_until))
        finally:
            heartbeat.cancel()
            heartbeat.add_done_callback(consume_result)
            if not body.done():
                # Cancelled twice while the body was stopping: nobody renews its claim
                # from here on, so go on cancelling it without waiting.
                body.add_done_callback(consume_result)
                keep_cancelling(body)
        outcome, reason, error = self._outcome(run, body, cancelled)
        recorded: str | None = None
        try:
            if outcome is not None:
                recorded = await self._record(run, outcome, error, reason)
            elif body.done() and not body.cancelled() and body.exception() is None and body.result():
                recorded = "succeeded"  # a transactional run recorded itself
        finally:
            # The run's span ends whatever happened: 'unrecorded' when this replica
            # recorded nothing (cut off, taken over, left for a retry elsewhere).
            metrics.slot_finished(run.spec.name, slot.at.isoformat(), recorded or "unrecorded",
                                  time.monotonic() - began, run.spec.handler or run.spec.name)
        if cancelled:
            raise asyncio.CancelledError

    async def _body(self, run: Run) -> bool:
        """The job itself; True when it recorded its own success (transactional)."""
        if run.spec.transactional:
            return await self._run_transactional(run)
        await _call(run.spec, run.slot)
        return False

    def _outcome(self, run: Run, body: asyncio.Task[bool], cancelled: bool,
                 ) -> tuple[str | None, str | None, str | None]:
        """What to record for a finished body: (state, reason, error), or Nones for nothing."""
        spec, slot = run.spec, run.slot
        if body.cancelled():
            if run.claim.lost is not None:
                log.warning("job %r slot %s attempt %d was cut off: %s; nothing is recorded,"
                            " the claim expires", spec.name, slot.at, slot.attempt, run.claim.lost)
                return None, None, None
            if cancelled or self._stopping:
                return "stopped", None, None
            return "failed", None, "CancelledError: the job was cancelled"
        exc = body.exception()
        if run.claim.lost is not None and exc is not None and not isinstance(exc, _TimedOut | _Superseded):
            # Cut off, and the cancellation came back as an error (a driver's, as the
            # connection broke): as for a cancelled body. (One that returned is
            # recorded below; job_finish checks that the attempt still holds the slot.)
            log.warning("job %r slot %s attempt %d was cut off: %s; it ended with %r; nothing is "
                        "recorded, the claim expires", spec.name, slot.at, slot.attempt,
                        run.claim.lost, exc)
            return None, None, None
        if isinstance(exc, _Superseded):
            log.warning("job %r slot %s attempt %d was taken over; its result is discarded",
                        spec.name, slot.at, slot.attempt)
            return None, None, None
        if isinstance(exc, _TimedOut):
            log.error("job %r slot %s failed: %s", spec.name, slot.at, exc)
            return "failed", "timeout", f"TimeoutError: {exc}"
        if exc is not None:
            log.error("job %r slot %s failed", spec.name, slot.at, exc_info=exc)
            return "failed", None, f"{type(exc).__name__}: {exc}"
        if body.result():
            return None, None, None  # a transactional run recorded itself
        # A body that ended normally is recorded even if the claim's window closed
        # meanwhile: job_finish only succeeds while this runner's attempt holds the slot.
        return "succeeded", None, None

    async def _record(self, run: Run, outcome: str, error: str | None,
                      reason: str | None = None) -> str | None:
        """Record a run's end, bounded: a record that cannot finish in time (a row lock,
        a server that does not answer) is abandoned and the claim left to expire.
        Returns the state recorded, or None if none was."""
        spec, slot = run.spec, run.slot
        if outcome == "stopped":
            if spec.on_crash == "retry":
                return None  # the claim expires and another replica retries it
            outcome, reason = "abandoned", "stopped"
        try:
            # Past the bound the statement is cancelled in its own task (which
            # cancels it on the server and gives its connection back, or
            # discards it); nothing else is ours to close, so no on_timeout.
            recorded = await finish_despite_cancel(self._finisher.finish(
                (spec.name, slot.at, run.runner, slot.attempt, outcome, reason, error),
            ), bound=CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("job %r slot %s: recording %s took longer than %.0f s and was abandoned;"
                        " the claim expires", spec.name, slot.at, outcome, CLEANUP_TIMEOUT)
            return None
        except Exception as exc:
            log.warning("job %r slot %s: could not record %s: %r", spec.name, slot.at, outcome, exc)
            return None
        if not recorded:
            log.warning("job %r slot %s attempt %d was taken over; its %s is not recorded",
                        spec.name, slot.at, slot.attempt, outcome)
            return None
        return outcome

    async def _run_transactional(self, run: Run) -> bool:
        """Run the job and record success in one transaction."""
        from .._drivers import fetchval_on

        spec, slot = run.spec, run.slot
        turn = self._tx_turns
        if turn is not None:
            await turn.acquire()
        try:
            # The slot's transaction lock makes a retry of the same slot wait until
            # this transaction has ended, so two attempts never run side by side.
            # A numeric key: a name would add a lock_names row and a metrics
            # label per slot, without bound.
            async with exclusive(self._source, lock_key(f"pgcoord.job:{slot.key}")) as conn:
                await _call(spec, dataclasses.replace(slot, conn=conn))
                if run.claim.lost is not None:
                    raise _Superseded()
                done = await fetchval_on(conn, query("job_finish"), (
                    spec.name, slot.at, run.runner, slot.attempt, "succeeded", None, None))
                if not done:
                    raise _Superseded()
        finally:
            if turn is not None:
                turn.release()
        return True

    async def _heartbeat(self, run: Run, body: asyncio.Task[Any]) -> None:
        """Renew the claim every claim_ttl/3 (sooner after a failure) while the trust
        window is open; when it closes, or the slot is no longer this attempt's,
        cancel the body."""
        spec, slot, claim = run.spec, run.slot, run.claim
        next_at = claim.sent_at + spec.claim_ttl / 3
        attempt: asyncio.Future[Any] | None = None
        try:
            while True:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                sent = time.monotonic()
                if sent >= claim.trust_until:  # e.g. the process was paused
                    await self._cut_off(run, body, "its trust window closed before a heartbeat was sent")
                    return
                attempt = asyncio.ensure_future(run_statement(
                    self._source, query("job_heartbeat"),
                    (spec.name, slot.at, run.runner, slot.attempt, int(spec.claim_ttl * 1000))))
                done, _ = await asyncio.wait({attempt}, timeout=claim.trust_until - sent)
                if not done:
                    await self._cut_off(run, body, "no heartbeat succeeded before its trust window closed")
                    return
                finished, attempt = attempt, None
                error = finished.exception()
                if error is None:
                    row = finished.result()
                    if row is None or not row[0]:
                        await self._cut_off(run, body, "the slot was taken over or its claim expired")
                        return
                    claim.renewed(sent)
                    next_at = sent + spec.claim_ttl / 3
                    continue
                # A transient error is not a loss while the trust window is open.
                log.warning("job %r slot %s: heartbeat failed, retrying: %r", spec.name, slot.at, error)
                next_at = time.monotonic() + min(spec.claim_ttl / 10,
                                                 max(0.0, claim.trust_until - time.monotonic()))
        finally:
            if attempt is not None and not attempt.done():
                attempt.cancel()
                attempt.add_done_callback(consume_result)

    def _lose(self, run: Run, body: asyncio.Task[Any], reason: str) -> None:
        run.claim.trust_until = 0.0  # trusted no more: whoever waits for the body insists now
        if run.claim.lost is None:
            run.claim.lost = f"claim lost: {reason}"
            # By handler: schedules added at run time (one per tenant) would make the
            # label set unbounded.
            metrics.lock_lost(run.spec.handler or run.spec.name, reason)
        body.cancel(self._cut_message(run))

    @staticmethod
    def _cut_message(run: Run) -> str:
        return f"pgcoord: job {run.spec.name!r} slot {run.slot.key}: {run.claim.lost}"

    async def _cut_off(self, run: Run, body: asyncio.Task[Any], reason: str) -> None:
        """Lose the claim and wait until the body has ended, cancelling it again
        while it runs on (a driver may have turned the cancellation into an error
        the job retries on): another runner may take the slot. Runs in the
        heartbeat's task (or one ``_execute`` or the scheduler owns)."""
        self._lose(run, body, reason)
        await self._insist(run, body)

    async def _insist(self, run: Run, body: asyncio.Task[Any]) -> None:
        again = await cancel_until_done(body, msg=self._cut_message(run), cancel_now=False)
        if again:
            log.warning("job %r slot %s: the body went on after its cancellation; cancelled it "
                        "%d more time(s)", run.spec.name, run.slot.at, again)

    async def _stop_runs(self) -> None:
        self._stopping = True
        runs = list(self._running.values())
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(run.task for run in runs if run.task is not None),
                             return_exceptions=True)
        # Cancelled before it began: nothing ran, so say so.
        await asyncio.gather(*(self._record(run, "stopped", None) for run in runs if not run.started),
                             return_exceptions=True)


class NotJoined(Exception):
    """The scheduler's member has no session right now (it is rejoining)."""


class _Superseded(Exception):
    pass


class _TimedOut(Exception):
    """The job ran past its schedule's ``timeout`` and was cancelled."""


async def _call(spec: Job, slot: Slot) -> None:
    """The job's function, cancelled past the schedule's timeout (as ``_TimedOut``)."""
    if spec.timeout is None:
        await spec.fn(slot)
        return
    try:
        async with asyncio.timeout(spec.timeout) as bound:
            await spec.fn(slot)
    except TimeoutError:
        if bound.expired():
            raise _TimedOut(f"the job ran longer than its timeout of {spec.timeout:g} s") from None
        raise
