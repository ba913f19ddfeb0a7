"""``Scheduler``: run-once cron across replicas, on ``pgcoord.job_slots``.

Every replica runs the same loop, with no leader: it reads the database clock,
works out which slots of each job are due, and tries to insert each one. The
table's primary key (job, slot instant) lets exactly one insert succeed, and
that replica runs the slot. Every slot since a job was registered ends as a
row in a terminal state with a reason: succeeded, failed, abandoned, missed or
skipped. Cron expressions are evaluated by cronsim, which follows Debian cron
across daylight-saving changes.

A running slot's claim is a lease: its runner heartbeats it every claim_ttl/3,
and believes it holds the claim only inside a trust window that closes (on the
monotonic clock) before the database would let anyone take the slot over, as
``Lease`` does. When the window closes — renewals failing or blocked, the slot
taken over, the process paused — the run is cancelled and records nothing.
When a runner dies, its claim expires; with ``on_crash="skip"`` any replica
then records the slot ``abandoned`` (at most once); with ``"retry"`` one
replica takes it over as the next attempt, up to ``max_attempts``, and a
superseded runner can no longer record a result — in transactional mode its
writes roll back with it.

The loop survives the database: a tick that fails (a lost connection, a
server restart, a terminated session) is logged and tried again after a
back-off; it never ends ``run()``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from . import metrics
from ._aio import CLEANUP_TIMEOUT, CleanupTimeout, absorb_cancel, consume_result, finish_despite_cancel
from ._drivers import check_source, run_statement
from ._drivers.capacity import pool_capacity
from ._keys import lock_key
from ._queries import query
from .errors import PgcoordError, SchemaMissing, UnsupportedConnection
from .leases import trust_margin
from .locks import exclusive

if TYPE_CHECKING:
    from .member import Member

__all__ = ["Scheduler", "Slot", "pool_capacity"]

log = logging.getLogger("pgcoord.scheduler")

UTC = dt.UTC
CATCH_UP = ("latest", "none", "all")
ON_CRASH = ("skip", "retry")
# Slots are worked out and marked in batches of at most this many. With
# catch_up="all" a longer backlog (a per-second job after a long outage) is
# run over the next ticks; with "latest" and "none" every batch is decided in
# the same tick, so that what runs is the latest slot, not the latest of the
# first batch.
MAX_SLOTS_PER_TICK = 2000
PRUNE_EVERY = 300.0  # seconds between retention passes of one replica
# After a failed tick (the database gone, a terminated session) the loop waits
# this long, doubling per failure up to BACKOFF_MAX, with jitter, and goes on.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0


def _utc(value: dt.datetime) -> dt.datetime:
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

    def __post_init__(self) -> None:
        if self.at.tzinfo is None or self.at.utcoffset() is None:
            raise ValueError(f"Slot.at must be an aware datetime, got {self.at!r}")
        if self.at.tzinfo is not UTC:
            object.__setattr__(self, "at", _utc(self.at))

    @property
    def key(self) -> str:
        """A stable idempotency key for this slot, e.g. ``nightly@2026-11-29T02:00:00Z``."""
        return f"{self.job}@{self.at.strftime('%Y-%m-%dT%H:%M:%SZ')}"


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

    def plan(self, due: list[dt.datetime], now: dt.datetime, *, final: bool,
             ) -> tuple[list[dt.datetime], dict[str, list[dt.datetime]]]:
        """Which of ``due`` to run and which to mark missed (by reason). ``final`` is
        False for a full batch that later slots follow: with catch_up="latest" none
        of it runs."""
        run: list[dt.datetime] = []
        missed: dict[str, list[dt.datetime]] = {}
        grace = self.deadline
        if self.catch_up == "all":
            for at in due:
                if grace is not None and (now - at).total_seconds() > grace:
                    missed.setdefault("deadline", []).append(at)
                else:
                    run.append(at)
        elif self.catch_up == "latest":
            if not final:
                return run, {"catch_up=latest": list(due)}
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
        return run, missed


def _seconds(value: Any, what: str, *, allow_none: bool = False, minimum: float = 0.0) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{what} must be a number of seconds >= {minimum}, got {value!r}")
    return float(value)


def _backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed ticks in a row: doubling, capped, jittered
    (so that replicas cut off together do not come back in step)."""
    base: float = min(BACKOFF_MAX, BACKOFF_FIRST * 2.0 ** max(0, failures - 1))
    return base * random.uniform(0.5, 1.0)


def _refuse_shared_connection(source: Any) -> None:
    """A SQLAlchemy engine whose pool hands one connection to every checkout is a
    bare connection in disguise: the scheduler's concurrent statements would meet on it."""
    if type(source).__module__.partition(".")[0] != "sqlalchemy":
        return
    from sqlalchemy.pool import AssertionPool, StaticPool

    pool = source.sync_engine.pool
    if isinstance(pool, StaticPool | AssertionPool):
        raise UnsupportedConnection(
            f"Scheduler runs statements concurrently and cannot use an engine with a "
            f"{type(pool).__name__}, which lends one connection to every checkout; "
            "use the default pool (AsyncAdaptedQueuePool) or NullPool"
        )


class _Claim:
    """What this runner believes about its claim on a running slot: a lease whose
    trust window closes before the database lets another replica take over."""

    def __init__(self, ttl: float, sent_at: float) -> None:
        self.ttl = ttl
        self.lost: str | None = None
        self.renewed(sent_at)

    def renewed(self, sent_at: float) -> None:
        """A claim or heartbeat sent at ``sent_at`` (monotonic) succeeded."""
        self.sent_at = sent_at
        self.trust_until = sent_at + self.ttl - trust_margin(self.ttl)


@dataclass(eq=False)
class _Run:
    spec: Job
    slot: Slot
    claim: _Claim
    #: The runner name the slot was claimed under (with a member, it names the
    #: member's incarnation, which may have changed since).
    runner: str
    task: asyncio.Task[None] | None = None
    body: asyncio.Task[Any] | None = None
    started: bool = False


class Scheduler:
    """Run-once cron across every replica that runs the same code; see DESIGN §4."""

    def __init__(
        self, source: Any, *, runner: str | None = None, tick: float = 1.0,
        member: Member | None = None,
    ) -> None:
        check_source(source, need_async=True, background="Scheduler")
        _refuse_shared_connection(source)
        if member is not None and runner is not None:
            raise ValueError("runner= and member= exclude each other: with a member, the runner "
                             "is named after the member")
        self._source = source
        self._member = member
        self._runner = runner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.jobs: dict[str, Job] = {}
        self._max_sleep = _seconds(tick, "tick", minimum=0.01) or 1.0
        self._capacity = pool_capacity(source)
        # A transactional run holds a pool connection for its whole body; the
        # ticks, heartbeats and records need one more. So at most capacity - 1
        # such runs hold one at a time, and the rest wait their turn.
        self._tx_turns = (asyncio.Semaphore(self._capacity - 1)
                          if self._capacity is not None and self._capacity > 1 else None)
        self._running: dict[tuple[str, dt.datetime], _Run] = {}
        self._run_task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._draining = False
        self._drain = 30.0
        self._clock_offset = 0.0  # database clock minus local wall clock
        self._wake = asyncio.Event()

    @property
    def runner(self) -> str:
        """The name this replica's claims carry. With a member it is
        ``<member name>/<member id>``: claims are tied to the member's session, so
        when that ends every replica expires them at once (and this replica stops
        the bodies that ran under them)."""
        member = self._member
        if member is None:
            return self._runner
        if member.id is None:
            raise _NotJoined()
        return f"{member.name}/{member.id}"

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
        if transactional and self._capacity is not None and self._capacity < 2:
            raise UnsupportedConnection(
                f"job {job!r}: a transactional job holds a pool connection for its whole run, "
                "and the scheduler needs another meanwhile to renew the slot's claim; this pool "
                f"lends at most {self._capacity} connection: give it max_size >= 2 "
                "(SQLAlchemy: pool_size + max_overflow >= 2)"
            )
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
        unhook = self._hook_member()
        try:
            await self._register()
            failures = 0
            while not self._draining:
                self._wake.clear()
                try:
                    wake = await self.tick()
                except Exception as exc:  # the database went away: back off, never end run()
                    failures += 1
                    pause = _backoff(failures)
                    log.warning("scheduler tick failed (%d in a row), trying again in %.2f s: %r",
                                failures, pause, exc)
                else:
                    failures = 0
                    pause = max(0.0, min(wake - self._db_now(), self._max_sleep))
                await self._sleep(pause)
            # Draining: no more claims; let running slots finish for a while.
            running = [run.task for run in self._running.values() if run.task is not None]
            if running:
                await asyncio.wait(running, timeout=self._drain)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            absorb_cancel()
        finally:
            unhook()
            try:
                await finish_despite_cancel(self._stop_runs(), bound=2 * CLEANUP_TIMEOUT)
            except CleanupTimeout:
                log.warning("scheduler: runs still going %.0f s after being cancelled were left"
                            " behind (their claims expire)", 2 * CLEANUP_TIMEOUT)
            self._run_task = None

    def _hook_member(self) -> Callable[[], None]:
        """With a member: expire a dead member's claims at once, and stop our own
        bodies when our member's session (which their claims are tied to) ends."""
        member = self._member
        if member is None:
            return lambda: None
        tasks: set[asyncio.Task[Any]] = set()

        def on_left(member_id: int) -> None:
            task = asyncio.ensure_future(self._expire_claims_of(member_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(consume_result)

        def on_session_lost(old_id: int) -> None:
            suffix = f"/{old_id}"
            for run in list(self._running.values()):
                if run.runner.endswith(suffix) and run.body is not None:
                    self._lose(run, run.body, "the member's session, which the claim is tied to, ended")

        unhook_left = member.on_member_left(on_left)
        unhook_lost = member.on_session_lost(on_session_lost)

        def unhook() -> None:
            unhook_left()
            unhook_lost()
            for task in tasks:
                task.cancel()

        return unhook

    async def _expire_claims_of(self, member_id: int) -> None:
        try:
            row = await run_statement(self._source, query("job_expire_member_claims"), (member_id,))
        except Exception as exc:  # the claims still expire on their own
            log.warning("scheduler: expiring the claims of member %d failed: %r", member_id, exc)
            return
        if row is not None and row[0]:
            log.warning("scheduler: member %d is gone; %d running claim(s) of it expired now",
                        member_id, row[0])
            for spec in self.jobs.values():
                spec.last_recover = 0.0  # look for them on this very tick
            self._wake.set()

    async def _register(self) -> None:
        """Register every job, trying again (backing off) while the database is away."""
        failures = 0
        for spec in self.jobs.values():
            while not self._draining:
                try:
                    row = await run_statement(self._source, query("job_register"),
                                              (spec.name, spec.expr, spec.tz.key))
                except SchemaMissing:
                    raise
                except Exception as exc:
                    failures += 1
                    pause = _backoff(failures)
                    log.warning("registering job %r failed, trying again in %.2f s: %r",
                                spec.name, pause, exc)
                    await self._sleep(pause)
                    continue
                assert row is not None
                spec.registered_at = _utc(row[0])
                self._clock_offset = row[1].timestamp() - time.time()
                break

    async def _sleep(self, seconds: float) -> None:
        """Sleep, or less if ``stop()`` or a finished run wakes the loop."""
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
        # cancellation that races the event being set.
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def stop(self, *, drain: float = 30.0) -> None:
        """Stop claiming slots, let running ones finish for up to ``drain`` seconds, then
        cancel the rest (recorded abandoned; a retry job's slot is left to another replica)."""
        task = self._run_task
        if task is None:
            return
        self._drain = drain
        self._draining = True
        self._wake.set()
        done, _ = await asyncio.wait({task}, timeout=drain + 2 * CLEANUP_TIMEOUT)
        self._stopping = True
        if not done:
            task.cancel()
            await asyncio.wait({task})

    def _db_now(self) -> float:
        return time.time() + self._clock_offset

    async def tick(self) -> float:
        """One pass over every job; returns when (database epoch seconds) to look again.
        A job whose pass fails is logged and looked at again next tick."""
        names = list(self.jobs)
        row = await run_statement(self._source, query("job_state"), (names,))
        assert row is not None
        now, lasts = _utc(row[0]), row[1]
        self._clock_offset = now.timestamp() - time.time()
        wake: float = now.timestamp() + self._max_sleep
        # Jobs are independent: decide them side by side (as many at once as
        # the pool lends connections), so the hundredth job is not a hundred
        # round trips late.
        await asyncio.gather(*(self._tick_job(self.jobs[name], now, None if last is None else _utc(last))
                               for name, last in zip(names, lasts, strict=True)))
        for name in names:
            wake = min(wake, self.jobs[name].next_after(now).timestamp())
        return wake

    async def _tick_job(self, spec: Job, now: dt.datetime, last: dt.datetime | None) -> None:
        try:
            await self._decide(spec, now, last)
            # Expired claims are looked for a few times per claim_ttl, not every tick.
            if time.monotonic() - spec.last_recover >= spec.claim_ttl / 3:
                spec.last_recover = time.monotonic()
                await self._recover(spec)
            if time.monotonic() - spec.last_prune > PRUNE_EVERY:
                spec.last_prune = time.monotonic()
                await self.prune(spec.name)
        except Exception as exc:
            log.warning("job %r: scheduling pass failed, trying again next tick: %r", spec.name, exc)

    async def _decide(self, spec: Job, now: dt.datetime, last: dt.datetime | None) -> None:
        assert spec.registered_at is not None
        after = max(last, spec.registered_at) if last is not None else spec.registered_at
        # With catch_up="all" a backlog runs one slot after another: a slot due
        # while another runs waits for a later tick instead of being skipped.
        on_overlap = ("run" if spec.allow_overlap
                      else "wait" if spec.catch_up == "all" else "skip")
        while True:
            due = spec.slots_after(after, now)
            if not due:
                return
            final = (spec.catch_up == "all" or len(due) < MAX_SLOTS_PER_TICK
                     or spec.next_after(due[-1]) > now)
            run, missed = spec.plan(due, now, final=final)
            for reason, slots in missed.items():
                await run_statement(self._source, query("job_mark_missed"), (spec.name, slots, reason))
            for at in run:
                if not await self._claim(spec, at, on_overlap):
                    return
            if final:
                return
            after = due[-1]

    async def _claim(self, spec: Job, at: dt.datetime, on_overlap: str) -> bool:
        """Try to claim slot ``at``; False when the job must wait for a later tick."""
        if spec.jitter:
            await asyncio.sleep(random.uniform(0, spec.jitter))
        try:
            runner = self.runner
        except _NotJoined:
            return False  # the member is (re)joining: claim nothing until it has
        sent = time.monotonic()
        claim = await run_statement(self._source, query("job_claim"),
                                    (spec.name, at, runner, int(spec.claim_ttl * 1000), on_overlap))
        if claim is None:
            return True  # another replica has it
        state, attempt = claim
        if state == "waiting":
            return False
        if state == "running":
            self._start(spec, Slot(spec.name, at, int(attempt)), sent, runner)
            return on_overlap != "wait"
        log.info("job %r slot %s skipped: the previous run is still going", spec.name, at)
        return True

    async def _recover(self, spec: Job) -> None:
        try:
            runner = self.runner
        except _NotJoined:
            return
        sent = time.monotonic()
        row = await run_statement(self._source, query("job_recover"),
                                  (spec.name, runner, int(spec.claim_ttl * 1000),
                                   spec.on_crash == "retry", spec.max_attempts))
        if row is not None:
            at, attempt = _utc(row[0]), int(row[1])
            log.warning("job %r slot %s: runner lost, retrying as attempt %d", spec.name, at, attempt)
            self._start(spec, Slot(spec.name, at, attempt), sent, runner)

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

    def _start(self, spec: Job, slot: Slot, sent: float, runner: str) -> None:
        run = _Run(spec, slot, _Claim(spec.claim_ttl, sent), runner)
        run.task = asyncio.create_task(self._execute(run), name=f"pgcoord-job:{slot.key}")
        self._running[(spec.name, slot.at)] = run
        run.task.add_done_callback(lambda _: self._finished(run))

    def _finished(self, run: _Run) -> None:
        key = (run.spec.name, run.slot.at)
        if self._running.get(key) is run:
            del self._running[key]
        self._wake.set()  # a waiting backlog may go on at once

    async def trigger(self, job: str) -> Slot:
        """Run ``job`` now, on this replica, without using up a scheduled slot."""
        spec = self._job(job)
        try:
            runner = self.runner
        except _NotJoined:
            raise PgcoordError("the scheduler's member is not joined (its session is being "
                               "reconnected); trigger again shortly") from None
        sent = time.monotonic()
        row = await run_statement(self._source, query("job_claim_now"),
                                  (spec.name, runner, int(spec.claim_ttl * 1000)))
        assert row is not None
        slot = Slot(spec.name, row[2], int(row[1]), manual=True)
        await self._execute(_Run(spec, slot, _Claim(spec.claim_ttl, sent), runner))
        return slot

    async def _execute(self, run: _Run) -> None:
        """Run a claimed slot: its body in a task of its own, beside the heartbeat
        that keeps the claim (and cancels the body when the claim is lost); then
        record the outcome. A cancellation of this task stops the body, records
        the slot stopped and is raised again."""
        run.started = True
        slot = run.slot
        body = run.body = asyncio.create_task(self._body(run), name=f"pgcoord-job-body:{slot.key}")
        heartbeat = asyncio.create_task(self._heartbeat(run, body), name=f"pgcoord-job-claim:{slot.key}")
        cancelled = False
        try:
            try:
                await asyncio.wait({body})
            except asyncio.CancelledError:
                cancelled = True
                body.cancel()
                await asyncio.wait({body})  # the body's own cleanup (a rollback) runs first
        finally:
            heartbeat.cancel()
            heartbeat.add_done_callback(consume_result)
            if not body.done():  # cancelled twice while the body was stopping: leave it
                body.add_done_callback(consume_result)
        outcome, error = self._outcome(run, body, cancelled)
        if outcome is not None:
            await self._record(run, outcome, error)
        if cancelled:
            raise asyncio.CancelledError

    async def _body(self, run: _Run) -> bool:
        """The job itself; True when it recorded its own success (transactional)."""
        if run.spec.transactional:
            return await self._run_transactional(run)
        await run.spec.fn(run.slot)
        return False

    def _outcome(self, run: _Run, body: asyncio.Task[bool], cancelled: bool,
                 ) -> tuple[str | None, str | None]:
        """What to record for a finished body: (state, error), or (None, None) for nothing."""
        spec, slot = run.spec, run.slot
        if body.cancelled():
            if run.claim.lost is not None:
                log.warning("job %r slot %s attempt %d was cut off: %s; nothing is recorded,"
                            " the claim expires", spec.name, slot.at, slot.attempt, run.claim.lost)
                return None, None
            if cancelled or self._stopping:
                return "stopped", None
            return "failed", "CancelledError: the job was cancelled"
        exc = body.exception()
        if isinstance(exc, _Superseded):
            log.warning("job %r slot %s attempt %d was taken over; its result is discarded",
                        spec.name, slot.at, slot.attempt)
            return None, None
        if exc is not None:
            log.error("job %r slot %s failed", spec.name, slot.at, exc_info=exc)
            return "failed", f"{type(exc).__name__}: {exc}"
        if body.result():
            return None, None  # a transactional run recorded itself
        # A body that ended normally is recorded even if the claim's window closed
        # meanwhile: job_finish only succeeds while this runner's attempt holds the slot.
        return "succeeded", None

    async def _record(self, run: _Run, outcome: str, error: str | None) -> None:
        """Record a run's end, bounded: a record that cannot finish in time (a row lock,
        a server that does not answer) is abandoned and the claim left to expire."""
        spec, slot = run.spec, run.slot
        if outcome == "stopped":
            if spec.on_crash == "retry":
                return  # the claim expires and another replica retries it
            outcome, reason = "abandoned", "stopped"
        else:
            reason = None
        try:
            # Past the bound the statement is cancelled in its own task (which
            # cancels it on the server and gives its connection back, or
            # discards it); nothing else is ours to close, so no on_timeout.
            row = await finish_despite_cancel(run_statement(
                self._source, query("job_finish"),
                (spec.name, slot.at, run.runner, slot.attempt, outcome, reason, error),
            ), bound=CLEANUP_TIMEOUT)
        except CleanupTimeout:
            log.warning("job %r slot %s: recording %s took longer than %.0f s and was abandoned;"
                        " the claim expires", spec.name, slot.at, outcome, CLEANUP_TIMEOUT)
            return
        except Exception as exc:
            log.warning("job %r slot %s: could not record %s: %r", spec.name, slot.at, outcome, exc)
            return
        if row is not None and not row[0]:
            log.warning("job %r slot %s attempt %d was taken over; its %s is not recorded",
                        spec.name, slot.at, slot.attempt, outcome)

    async def _run_transactional(self, run: _Run) -> bool:
        """Run the job and record success in one transaction."""
        from ._drivers import fetchval_on

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
                await spec.fn(Slot(slot.job, slot.at, slot.attempt, slot.manual, conn))
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

    async def _heartbeat(self, run: _Run, body: asyncio.Task[Any]) -> None:
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
                    self._lose(run, body, "its trust window closed before a heartbeat was sent")
                    return
                attempt = asyncio.ensure_future(run_statement(
                    self._source, query("job_heartbeat"),
                    (spec.name, slot.at, run.runner, slot.attempt, int(spec.claim_ttl * 1000))))
                done, _ = await asyncio.wait({attempt}, timeout=claim.trust_until - sent)
                if not done:
                    self._lose(run, body, "no heartbeat succeeded before its trust window closed")
                    return
                finished, attempt = attempt, None
                error = finished.exception()
                if error is None:
                    row = finished.result()
                    if row is None or not row[0]:
                        self._lose(run, body, "the slot was taken over or its claim expired")
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

    def _lose(self, run: _Run, body: asyncio.Task[Any], reason: str) -> None:
        if run.claim.lost is None:
            run.claim.lost = f"claim lost: {reason}"
            metrics.lock_lost(run.spec.name, reason)
        body.cancel(f"pgcoord: job {run.spec.name!r} slot {run.slot.key}: {run.claim.lost}")

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


class _NotJoined(Exception):
    """The scheduler's member has no session right now (it is rejoining)."""


class _Superseded(Exception):
    pass
