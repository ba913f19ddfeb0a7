"""``Scheduler``: run-once cron across replicas, on ``pgcoord.job_slots``.

Every replica runs the same loop, with no leader: it reads the database clock,
works out which slots of each job are due, and tries to insert each one. The
table's primary key (job, slot instant) lets exactly one insert succeed, and
that replica runs the slot. Every slot since a job was registered ends as a
row in a terminal state with a reason: succeeded, failed, abandoned, missed or
skipped. Cron expressions are evaluated by cronsim, which follows Debian cron
across daylight-saving changes.

A running slot's claim is a lease: its runner heartbeats it every claim_ttl/3.
When a runner dies, the claim expires; with ``on_crash="skip"`` any replica
then records the slot ``abandoned`` (at most once); with ``"retry"`` one
replica takes it over as the next attempt, up to ``max_attempts``, and a
superseded runner can no longer record a result — in transactional mode its
writes roll back with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from ._aio import CLEANUP_TIMEOUT, absorb_cancel, finish_despite_cancel
from ._drivers import check_source, run_statement
from ._queries import query
from .locks import exclusive

__all__ = ["Scheduler", "Slot"]

log = logging.getLogger("pgcoord.scheduler")

UTC = dt.UTC
CATCH_UP = ("latest", "none", "all")
ON_CRASH = ("skip", "retry")
# Per tick and job, at most this many slots are decided; a longer backlog
# (a per-second job after a long outage) is worked off over the next ticks.
MAX_SLOTS_PER_TICK = 2000
PRUNE_EVERY = 300.0  # seconds between retention passes of one replica


@dataclass(frozen=True)
class Slot:
    """One scheduled run: ``job`` at instant ``at`` (aware, UTC)."""

    job: str
    at: dt.datetime
    attempt: int
    manual: bool = False
    #: A connection in the run's transaction (``transactional=True`` jobs only).
    conn: Any = None

    @property
    def key(self) -> str:
        """A stable idempotency key for this slot, e.g. ``nightly@2026-11-29T02:00:00Z``."""
        return f"{self.job}@{self.at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"


JobFn = Callable[[Slot], Coroutine[Any, Any, Any]]


@dataclass
class Job:
    name: str
    expr: str
    tz: ZoneInfo
    fn: JobFn
    on_crash: str
    max_attempts: int
    catch_up: str
    deadline: float | None
    transactional: bool
    allow_overlap: bool
    jitter: float
    claim_ttl: float
    keep: float
    registered_at: dt.datetime | None = None
    last_prune: float = field(default=0.0)
    last_recover: float = field(default=0.0)

    def slots_after(self, after: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
        """Scheduled instants in (after, until], in UTC, at most MAX_SLOTS_PER_TICK."""
        found: list[dt.datetime] = []
        for local in CronSim(self.expr, after.astimezone(self.tz)):
            at = local.astimezone(UTC)
            if at > until or len(found) >= MAX_SLOTS_PER_TICK:
                break
            if at > after:
                found.append(at)
        return found

    def next_after(self, after: dt.datetime) -> dt.datetime:
        for local in CronSim(self.expr, after.astimezone(self.tz)):
            at = local.astimezone(UTC)
            if at > after:
                return at
        raise ValueError(f"{self.expr!r} never fires")


def _seconds(value: Any, what: str, *, allow_none: bool = False, minimum: float = 0.0) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{what} must be a number of seconds >= {minimum}, got {value!r}")
    return float(value)


class Scheduler:
    """Run-once cron across every replica that runs the same code; see DESIGN §4."""

    def __init__(self, source: Any, *, runner: str | None = None, tick: float = 1.0) -> None:
        check_source(source, need_async=True)
        self._source = source
        self.runner = runner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.jobs: dict[str, Job] = {}
        self._max_sleep = _seconds(tick, "tick", minimum=0.01)
        self._running: dict[tuple[str, dt.datetime], tuple[Job, Slot, asyncio.Task[None]]] = {}
        self._run_task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._draining = False
        self._drain = 30.0
        self._clock_offset = 0.0  # database clock minus local wall clock
        self._wake = asyncio.Event()
        self._recorded: set[tuple[str, dt.datetime]] = set()

    # -- registration ------------------------------------------------------------------

    def cron(
        self, job: str, expr: str, *, tz: str = "UTC", on_crash: str = "skip",
        max_attempts: int = 3, catch_up: str = "latest", deadline: float | None = None,
        transactional: bool = False, allow_overlap: bool = False, jitter: float = 0.0,
        claim_ttl: float = 30.0, keep: float = 30 * 86400.0,
    ) -> Callable[[JobFn], JobFn]:
        """Register ``fn`` as job ``job`` on cron ``expr`` (5 fields, or 6 with seconds first)."""
        if not isinstance(job, str) or not job:
            raise ValueError("job name must be a non-empty str")
        if job in self.jobs:
            raise ValueError(f"job {job!r} is already registered")
        if not isinstance(expr, str):
            raise ValueError("cron expression must be a str")
        try:
            zone = ZoneInfo(tz)
        except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
            raise ValueError(f"unknown time zone {tz!r}") from exc
        if len(expr.split()) not in (5, 6):
            raise ValueError(f"cron expression {expr!r} must have 5 fields, or 6 with seconds first")
        try:
            next(iter(CronSim(expr, dt.datetime.now(zone))))
        except (CronSimError, StopIteration) as exc:
            raise ValueError(f"bad cron expression {expr!r}: {exc}") from exc
        if on_crash not in ON_CRASH:
            raise ValueError(f"on_crash must be one of {ON_CRASH}, not {on_crash!r}")
        if catch_up not in CATCH_UP:
            raise ValueError(f"catch_up must be one of {CATCH_UP}, not {catch_up!r}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        spec = Job(
            name=job, expr=expr, tz=zone, fn=None,  # type: ignore[arg-type]
            on_crash=on_crash, max_attempts=max_attempts, catch_up=catch_up,
            deadline=_seconds(deadline, "deadline", allow_none=True),
            transactional=bool(transactional), allow_overlap=bool(allow_overlap),
            jitter=_seconds(jitter, "jitter") or 0.0,
            claim_ttl=_seconds(claim_ttl, "claim_ttl", minimum=0.3) or 30.0,
            keep=_seconds(keep, "keep", minimum=1.0) or 30 * 86400.0,
        )

        def register(fn: JobFn) -> JobFn:
            if not asyncio.iscoroutinefunction(fn):
                raise TypeError(f"job {job!r} must be an async function")
            spec.fn = fn
            self.jobs[job] = spec
            return fn

        return register

    def next_runs(self, job: str, n: int = 5, *, after: dt.datetime | None = None) -> list[dt.datetime]:
        """The next ``n`` scheduled instants of ``job`` (aware, UTC)."""
        spec = self._job(job)
        at = (after or dt.datetime.now(UTC)).astimezone(UTC)
        runs = []
        for _ in range(n):
            at = spec.next_after(at)
            runs.append(at)
        return runs

    def _job(self, job: str) -> Job:
        try:
            return self.jobs[job]
        except KeyError:
            raise ValueError(f"no job named {job!r}") from None

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every registered job's due slots, on this replica, until ``stop()``."""
        if not self.jobs:
            raise ValueError("no jobs registered: decorate functions with @scheduler.cron(...)")
        if self._run_task is not None:
            raise RuntimeError("this Scheduler is already running")
        self._run_task, self._stopping, self._draining = asyncio.current_task(), False, False
        try:
            for spec in self.jobs.values():
                row = await run_statement(self._source, query("job_register"),
                                 (spec.name, spec.expr, spec.tz.key))
                assert row is not None
                spec.registered_at = row[0]
                self._clock_offset = row[1].timestamp() - time.time()
            while not self._draining:
                self._wake.clear()
                wake = await self.tick()
                pause = max(0.0, min(wake - self._db_now(), self._max_sleep or 1.0))
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                # cancellation that races the event being set.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await self._wake.wait()
            # Draining: no more claims; let running slots finish for a while.
            running = [task for _, _, task in self._running.values()]
            if running:
                await asyncio.wait(running, timeout=self._drain)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            absorb_cancel()
        finally:
            await finish_despite_cancel(self._stop_runs())
            self._run_task = None

    async def stop(self, *, drain: float = 30.0) -> None:
        """Stop claiming slots, let running ones finish for up to ``drain`` seconds, then
        cancel the rest (recorded abandoned; a retry job's slot is left to another replica)."""
        task = self._run_task
        if task is None:
            return
        self._drain = drain
        self._draining = True
        self._wake.set()
        done, _ = await asyncio.wait({task}, timeout=drain + CLEANUP_TIMEOUT)
        self._stopping = True
        if not done:
            task.cancel()
            await asyncio.wait({task})

    def _db_now(self) -> float:
        return time.time() + self._clock_offset

    async def tick(self) -> float:
        """One pass over every job; returns when (database epoch seconds) to look again."""
        names = list(self.jobs)
        row = await run_statement(self._source, query("job_state"), (names,))
        assert row is not None
        now, lasts = row[0], row[1]
        self._clock_offset = now.timestamp() - time.time()
        wake: float = now.timestamp() + (self._max_sleep or 1.0)
        # Jobs are independent: decide them side by side (as many at once as
        # the pool lends connections), so the hundredth job is not a hundred
        # round trips late.
        await asyncio.gather(*(self._tick_job(self.jobs[name], now, last)
                               for name, last in zip(names, lasts, strict=True)))
        for name in names:
            wake = min(wake, self.jobs[name].next_after(now).timestamp())
        return wake

    async def _tick_job(self, spec: Job, now: dt.datetime, last: dt.datetime | None) -> None:
        await self._decide(spec, now, last)
        # Expired claims are looked for a few times per claim_ttl, not every tick.
        if time.monotonic() - spec.last_recover >= spec.claim_ttl / 3:
            spec.last_recover = time.monotonic()
            await self._recover(spec)
        if time.monotonic() - spec.last_prune > PRUNE_EVERY:
            spec.last_prune = time.monotonic()
            await self.prune(spec.name)

    async def _decide(self, spec: Job, now: dt.datetime, last: dt.datetime | None) -> None:
        assert spec.registered_at is not None
        after = max(last, spec.registered_at) if last is not None else spec.registered_at
        due = spec.slots_after(after, now)
        if not due:
            return
        run: list[dt.datetime] = []
        missed: dict[str, list[dt.datetime]] = {}
        grace = spec.deadline
        if spec.catch_up == "all":
            for at in due:
                if grace is not None and (now - at).total_seconds() > grace:
                    missed.setdefault("deadline", []).append(at)
                else:
                    run.append(at)
        elif spec.catch_up == "latest":
            *older, latest = due
            if older:
                missed["catch_up=latest"] = older
            if grace is not None and (now - latest).total_seconds() > grace:
                missed.setdefault("deadline", []).append(latest)
            else:
                run.append(latest)
        else:  # none: only a slot that is due right now
            grace = 2.0 if grace is None else grace
            for at in due:
                if (now - at).total_seconds() > grace:
                    missed.setdefault("catch_up=none", []).append(at)
                else:
                    run.append(at)
        for reason, slots in missed.items():
            await run_statement(self._source, query("job_mark_missed"), (spec.name, slots, reason))
        # With catch_up="all" a backlog runs one slot after another: a slot due
        # while another runs waits for a later tick instead of being skipped.
        on_overlap = ("run" if spec.allow_overlap
                      else "wait" if spec.catch_up == "all" else "skip")
        for at in run:
            if spec.jitter:
                await asyncio.sleep(random.uniform(0, spec.jitter))
            claim = await run_statement(self._source, query("job_claim"),
                               (spec.name, at, self.runner, int(spec.claim_ttl * 1000), on_overlap))
            if claim is None:
                continue  # another replica has it
            state, attempt = claim
            if state == "waiting":
                return
            if state == "running":
                self._start(spec, Slot(spec.name, at, int(attempt)))
                if on_overlap == "wait":
                    return
            else:
                log.info("job %r slot %s skipped: the previous run is still going", spec.name, at)

    async def _recover(self, spec: Job) -> None:
        row = await run_statement(self._source, query("job_recover"),
                         (spec.name, self.runner, int(spec.claim_ttl * 1000),
                          spec.on_crash == "retry", spec.max_attempts))
        if row is not None:
            at, attempt = row
            log.warning("job %r slot %s: runner lost, retrying as attempt %d", spec.name, at, attempt)
            self._start(spec, Slot(spec.name, at, int(attempt)))

    async def prune(self, job: str, *, batch: int = 1000) -> int:
        """Delete this job's finished rows older than its ``keep``, in batches; the count."""
        spec = self._job(job)
        total = 0
        while True:
            row = await run_statement(self._source, query("job_prune"),
                             (spec.name, int(spec.keep * 1000), batch))
            deleted = int(row[0]) if row else 0
            total += deleted
            if deleted < batch:
                return total

    # -- running slots ---------------------------------------------------------------------

    def _start(self, spec: Job, slot: Slot) -> None:
        task = asyncio.create_task(self._execute(spec, slot), name=f"pgcoord-job:{slot.key}")
        self._running[(spec.name, slot.at)] = (spec, slot, task)
        task.add_done_callback(lambda t: self._finished(spec.name, slot.at, t))

    def _finished(self, job: str, at: dt.datetime, task: asyncio.Task[None]) -> None:
        if self._running.get((job, at), (None, None, None))[2] is task:
            del self._running[(job, at)]
        if not task.cancelled():
            self._recorded.discard((job, at))
        self._wake.set()  # a waiting backlog may go on at once

    async def trigger(self, job: str) -> Slot:
        """Run ``job`` now, on this replica, without using up a scheduled slot."""
        spec = self._job(job)
        row = await run_statement(self._source, query("job_claim_now"),
                         (spec.name, self.runner, int(spec.claim_ttl * 1000)))
        assert row is not None
        slot = Slot(spec.name, row[2], int(row[1]), manual=True)
        try:
            await self._execute(spec, slot)
        finally:
            self._recorded.discard((spec.name, slot.at))
        return slot

    async def _execute(self, spec: Job, slot: Slot) -> None:
        body = asyncio.current_task()
        heartbeat = asyncio.create_task(self._heartbeat(spec, slot, body))
        outcome, error = "succeeded", None
        try:
            if spec.transactional:
                recorded = await self._run_transactional(spec, slot)
                if recorded:
                    return
            else:
                await spec.fn(slot)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            outcome, error = "stopped", None
        except _Superseded:
            log.warning("job %r slot %s attempt %d was taken over; its result is discarded",
                        spec.name, slot.at, slot.attempt)
            return
        except Exception as exc:
            log.exception("job %r slot %s failed", spec.name, slot.at)
            outcome, error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        await finish_despite_cancel(self._record(spec, slot, outcome, error))

    async def _record(self, spec: Job, slot: Slot, outcome: str, error: str | None) -> None:
        self._recorded.add((spec.name, slot.at))
        if outcome == "stopped":
            if spec.on_crash == "retry":
                return  # the claim expires and another replica retries it
            outcome, reason = "abandoned", "stopped"
        else:
            reason = None
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT):
                row = await run_statement(self._source, query("job_finish"),
                                 (spec.name, slot.at, self.runner, slot.attempt, outcome, reason, error))
        except Exception as exc:
            log.warning("job %r slot %s: could not record %s: %r", spec.name, slot.at, outcome, exc)
            return
        if row is not None and not row[0]:
            log.warning("job %r slot %s attempt %d was taken over; its %s is not recorded",
                        spec.name, slot.at, slot.attempt, outcome)

    async def _run_transactional(self, spec: Job, slot: Slot) -> bool:
        """Run the job and record success in one transaction; False if it must be recorded apart."""
        from ._drivers import fetchval_on

        # The slot's transaction lock makes a retry of the same slot wait until
        # this transaction has ended, so two attempts never run side by side.
        async with exclusive(self._source, f"pgcoord.job:{slot.key}") as conn:
            await spec.fn(Slot(slot.job, slot.at, slot.attempt, slot.manual, conn))
            done = await fetchval_on(conn, query("job_finish"), (
                spec.name, slot.at, self.runner, slot.attempt, "succeeded", None, None))
            if not done:
                raise _Superseded()
        return True

    async def _heartbeat(self, spec: Job, slot: Slot, body: asyncio.Task[Any] | None) -> None:
        interval = spec.claim_ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                row = await run_statement(self._source, query("job_heartbeat"),
                                 (spec.name, slot.at, self.runner, slot.attempt,
                                  int(spec.claim_ttl * 1000)))
            except Exception as exc:
                log.warning("job %r slot %s: heartbeat failed: %r", spec.name, slot.at, exc)
                continue
            if row is not None and not row[0] and body is not None:
                body.cancel("pgcoord: slot taken over by another runner")
                return

    async def _stop_runs(self) -> None:
        self._stopping = True
        entries = list(self._running.values())
        for _, _, task in entries:
            task.cancel()
        await asyncio.gather(*(task for _, _, task in entries), return_exceptions=True)
        for spec, slot, task in entries:
            if task.cancelled() and (spec.name, slot.at) not in self._recorded:
                # Cancelled before it began: nothing ran, so say so.
                await self._record(spec, slot, "stopped", None)
        self._recorded.clear()


class _Superseded(Exception):
    pass
