"""Running one claimed slot: the job's body beside the heartbeat that keeps its
claim, its timeout, and the record of how it ended.

A running slot's claim is a tenure (``leases/tenure.py``), as a ``Lease`` is: the
job heartbeat renews it every claim_ttl/3, and it is believed only inside a trust
window that closes (on the monotonic clock) before the database would let anyone
take the slot over. When it is lost — renewals failing or blocked until the
window closed, the slot taken over, the process paused, the member's session
ended — the run is cancelled until it ends and records nothing. A superseded
runner can no longer record a result; in transactional mode its writes roll back
with it. A run past its schedule's ``timeout`` is cancelled the same way, until it
ends, and recorded failed, reason ``timeout``, whatever it ended with.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from dataclasses import dataclass
from typing import Any

from .._core import readonly
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
from ..leases.tenure import Renewal, Tenure, keep_renewed
from ..locks.advisory import exclusive
from ..observability import metrics
from .cron import Job
from .finisher import Entry, Finisher

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



def claim_tenure(spec: Job, slot: Slot, sent: float) -> Tenure:
    """The tenure of a claim on ``slot`` made by a statement sent at ``sent``
    (monotonic): fenced by the attempt, trusted for claim_ttl less the margin.
    Named by handler: schedules added at run time (one per tenant) would make the
    metrics' label set unbounded."""
    tenure = Tenure(spec.handler or spec.name, spec.claim_ttl)
    tenure.taken(slot.attempt, sent)
    return tenure


@dataclass(eq=False)
class Run:
    spec: Job
    slot: Slot
    #: The claim: a tenure renewed by the job's heartbeat (``_renewal``).
    tenure: Tenure
    #: The runner name the slot was claimed under (with a member, it names the
    #: member's incarnation, which may have changed since).
    runner: str
    task: asyncio.Task[None] | None = None
    body: asyncio.Task[Any] | None = None
    started: bool = False
    #: The body ran past the schedule's timeout: cancelled until it ended.
    timed_out: bool = False


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
        run = Run(spec, slot, claim_tenure(spec, slot, sent), runner)
        run.task = asyncio.create_task(self._execute(run), name=f"pgcoord-job:{slot.key}")
        self._running[(spec.name, slot.at)] = run
        run.task.add_done_callback(lambda _: self._finished(run))

    def _finished(self, run: Run) -> None:
        key = (run.spec.name, run.slot.at)
        if self._running.get(key) is run:
            del self._running[key]
        self._wake.set()  # a waiting backlog may go on at once

    async def _execute(self, run: Run) -> None:
        """Run a claimed slot: its body in a task of its own, beside the renewals that
        keep the claim (a loss cancels the body); cancel it until it ends should the
        claim be lost or the timeout pass; then record the outcome, the claim still
        renewed until the record is done. A cancellation of this task stops the
        body, records the slot stopped and is raised again."""
        run.started = True
        slot, tenure = run.slot, run.tenure
        began = time.monotonic()
        metrics.slot_started(run.spec.name, slot.at.isoformat(), slot.attempt, run.runner)
        body = run.body = asyncio.create_task(self._body(run), name=f"pgcoord-job-body:{slot.key}")
        tenure.on_lost(lambda reason: self._on_lost(run, body, reason))
        renewer = asyncio.create_task(keep_renewed(tenure, self._renewal(run)),
                                      name=f"pgcoord-job-claim:{slot.key}")
        cancelled = False
        recorded: str | None = None
        try:
            try:
                await self._until_ended(run, body)
            except asyncio.CancelledError:
                cancelled = True
                # The body's own cleanup (a rollback) runs first, while the claim is
                # still ours: it is cancelled again from the sooner of the claim's
                # window closing and halfway to the stop's bound (at once if the
                # claim is lost), so that it has ended before the renewals stop.
                calm_until = time.monotonic() + CLEANUP_TIMEOUT / 2
                await cancel_until_done(body, insist_from=lambda: min(tenure.trust.until, calm_until))
            outcome, reason, error = self._outcome(run, body, cancelled)
            if outcome is not None:
                recorded = await self._record(run, outcome, error, reason)
            elif body.done() and not body.cancelled() and body.exception() is None and body.result():
                recorded = "succeeded"  # a transactional run recorded itself
        finally:
            renewer.cancel()
            renewer.add_done_callback(consume_result)
            if not body.done():
                # Cancelled twice while the body was stopping: nobody renews its claim
                # from here on, so go on cancelling it without waiting.
                body.add_done_callback(consume_result)
                keep_cancelling(body)
            # The run's span ends whatever happened: 'unrecorded' when this replica
            # recorded nothing (cut off, taken over, left for a retry elsewhere).
            metrics.slot_finished(run.spec.name, slot.at.isoformat(), recorded or "unrecorded",
                                  time.monotonic() - began, run.spec.handler or run.spec.name)
        if cancelled:
            raise asyncio.CancelledError

    async def _until_ended(self, run: Run, body: asyncio.Task[Any]) -> None:
        """Wait for the body; should its claim be lost or its timeout pass first,
        cancel it until it has ended (one cancellation is not always enough: a driver
        can turn it into an error the job retries on)."""
        tenure, timeout = run.tenure, run.spec.timeout
        lost = asyncio.ensure_future(tenure.lost_event.wait())
        try:
            await asyncio.wait({body, lost}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if body.done():
            return
        if tenure.lost is None:
            run.timed_out = True
            log.error("job %r slot %s ran past its timeout of %g s; cancelling it",
                      run.spec.name, run.slot.at, timeout)
            msg = (f"pgcoord: job {run.spec.name!r} slot {run.slot.key}: "
                   f"ran longer than its timeout of {timeout:g} s")
            cancel_now = True
        else:  # the loss listener has cancelled it once already
            msg, cancel_now = self._cut_message(run), False
        again = await cancel_until_done(body, msg=msg, cancel_now=cancel_now)
        if again:
            log.warning("job %r slot %s: the body went on after its cancellation; cancelled it "
                        "%d more time(s)", run.spec.name, run.slot.at, again)

    def _renewal(self, run: Run) -> Renewal:
        """The claim's renewal: the job heartbeat, every claim_ttl/3 (sooner after a
        failure, which is no loss while the trust window is open)."""
        spec, slot, runner = run.spec, run.slot, run.runner
        params = (spec.name, slot.at, runner, slot.attempt, int(spec.claim_ttl * 1000))

        async def renew() -> bool | None:
            row = await run_statement(self._source, query("job_heartbeat"), params)
            return True if row is not None and row[0] else None  # None: taken over, expired

        return Renewal(renew, every=spec.claim_ttl / 3, retry_every=spec.claim_ttl / 10)

    def _on_lost(self, run: Run, body: asyncio.Task[Any], reason: str) -> None:
        """The claim is lost (taken over, renewals failing until the window closed, the
        member's session ended): cancel the body; whoever waits for it insists."""
        if body.done():
            return  # the run had ended (its record ends the claim): nothing was cut off
        log.warning("job %r slot %s attempt %d: claim lost: %s", run.spec.name, run.slot.at,
                    run.slot.attempt, reason)
        metrics.lock_lost(run.spec.handler or run.spec.name, reason)
        body.cancel(self._cut_message(run))

    async def _body(self, run: Run) -> bool:
        """The job itself; True when it recorded its own success (transactional)."""
        if run.spec.transactional:
            return await self._run_transactional(run)
        await run.spec.fn(run.slot)
        return False

    def _outcome(self, run: Run, body: asyncio.Task[bool], cancelled: bool,
                 ) -> tuple[str | None, str | None, str | None]:
        """What to record for a finished body: (state, reason, error), or Nones for nothing.
        A body that pgcoord cancelled (timeout, stop) ends as that, whatever it ended
        with: a driver may have turned the cancellation into an error."""
        spec, slot, lost = run.spec, run.slot, run.tenure.lost
        exc = None if body.cancelled() else body.exception()
        if run.timed_out:
            if not body.cancelled() and exc is None and body.result():
                return None, None, None  # a transactional run recorded itself in time
            cause = "" if exc is None else f"; it ended with {type(exc).__name__}: {exc}"
            log.error("job %r slot %s failed: it ran past its timeout%s", spec.name, slot.at, cause)
            return ("failed", "timeout",
                    f"TimeoutError: the job ran longer than its timeout of {spec.timeout:g} s{cause}")
        if isinstance(exc, _Superseded):
            log.warning("job %r slot %s attempt %d was taken over; its result is discarded",
                        spec.name, slot.at, slot.attempt)
            return None, None, None
        if lost is not None and (body.cancelled() or exc is not None):
            # Cut off; the cancellation may have come back as an error (a driver's, as
            # the connection broke). (One that returned is recorded below: job_finish
            # checks that the attempt still holds the slot.)
            log.warning("job %r slot %s attempt %d was cut off: claim lost: %s; %snothing is "
                        "recorded, the claim expires", spec.name, slot.at, slot.attempt, lost,
                        "" if exc is None else f"it ended with {exc!r}; ")
            return None, None, None
        if cancelled and (body.cancelled() or exc is not None):
            return "stopped", None, None if exc is None else f"{type(exc).__name__}: {exc}"
        if body.cancelled():
            if self._stopping:
                return "stopped", None, None
            return "failed", None, "CancelledError: the job was cancelled"
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
        a server that does not answer) is abandoned and the claim left to expire; one
        that fails is tried again while the claim is still ours (it is renewed until
        then). Returns the state recorded, or None if none was."""
        spec, slot = run.spec, run.slot
        if outcome == "stopped":
            if spec.on_crash == "retry":
                return None  # the claim expires and another replica retries it
            outcome, reason = "abandoned", "stopped"
        entry = (spec.name, slot.at, run.runner, slot.attempt, outcome, reason, error)
        try:
            # Past the bound the statement is cancelled in its own task (which
            # cancels it on the server and gives its connection back, or
            # discards it); nothing else is ours to close, so no on_timeout.
            recorded = await finish_despite_cancel(self._record_retried(run, entry),
                                                   bound=CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("job %r slot %s: recording %s took longer than %.0f s and was abandoned;"
                        " the claim expires", spec.name, slot.at, outcome, CLEANUP_TIMEOUT)
            return None
        except Exception as exc:
            # Through the notice: a demoted primary fails the record of every slot
            # that was running, and it is the read-only state the operator needs told.
            readonly.retrying(log, exc, "job %r slot %s: could not record %s: %r; the claim expires",
                              spec.name, slot.at, outcome, exc)
            return None
        if not recorded:
            log.warning("job %r slot %s attempt %d was taken over; its %s is not recorded",
                        spec.name, slot.at, slot.attempt, outcome)
            return None
        return outcome

    async def _record_retried(self, run: Run, entry: Entry) -> bool:
        pause = 0.05
        while True:
            try:
                return await self._finisher.finish(entry)
            except CleanupTimeout:
                raise  # held up past the bound (a row lock): trying again would be too
            except Exception as exc:
                # Tried again only while the claim is trusted: past it, another
                # replica may have recorded the slot or taken it over.
                if run.tenure.trust.left() <= pause:
                    raise
                readonly.retrying(log, exc, "job %r slot %s: recording %s failed, trying again: %r",
                                  run.spec.name, run.slot.at, entry[4], exc)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

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
                await spec.fn(dataclasses.replace(slot, conn=conn))
                if run.tenure.lost is not None:
                    raise _Superseded()
                done = await fetchval_on(conn, query("job_finish"), (
                    spec.name, slot.at, run.runner, slot.attempt, "succeeded", None, None))
                if not done:
                    raise _Superseded()
        finally:
            if turn is not None:
                turn.release()
        return True

    @staticmethod
    def _cut_message(run: Run) -> str:
        return f"pgcoord: job {run.spec.name!r} slot {run.slot.key}: claim lost: {run.tenure.lost}"

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
