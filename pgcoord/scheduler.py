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
import dataclasses
import datetime as dt
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import metrics
from . import schedules as _schedules
from ._aio import CLEANUP_TIMEOUT, CleanupTimeout, absorb_cancel, consume_result, finish_despite_cancel
from ._cron import Handler, Job, check_expr, check_zone, seconds, slots_between
from ._drivers import check_source, run_statement
from ._drivers.capacity import pool_capacity
from ._finisher import Finisher
from ._jobalerts import FailingWatch
from ._keys import lock_key
from ._queries import query
from .errors import PgcoordError, SchemaMissing, UnsupportedConnection
from .leases import trust_margin
from .locks import exclusive
from .schedules import SCHEDULES_CHANNEL, ScheduleInfo, check_options

if TYPE_CHECKING:
    from .member import Member

__all__ = ["Scheduler", "Slot", "pool_capacity"]

log = logging.getLogger("pgcoord.scheduler")

UTC = dt.UTC
PRUNE_EVERY = 300.0  # seconds between retention passes of one replica
ALERT_EVERY = 60.0  # seconds between looks for schedules that keep failing
# Entries per schedule_decide statement: a tick that finds more due (10,000
# schedules on the same minute) sends several, each bounded in time, in an
# order of its own, so that racing replicas mostly win different batches and
# the runs spread over them.
DECIDE_BATCH = 500
_TINY = dt.timedelta(microseconds=1)
BACKFILL_MAX = 10_000  # slots per backfill() call
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
    #: The schedule's JSON arguments (``add(..., args=...)``); ``{}`` for none.
    args: Any = None

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


#: One slot to decide: (job, at, version, act, reason, on_overlap, claim_ms).
_Entry = tuple[str, dt.datetime, int, str, str | None, str, int]


def _batches(groups: list[list[_Entry]]) -> list[list[_Entry]]:
    """The entries in batches of about DECIDE_BATCH, a job's entries never split
    (schedule_decide looks at overlaps within a batch), in a random order."""
    batches: list[list[_Entry]] = [[]]
    for group in groups:
        if batches[-1] and len(batches[-1]) + len(group) > DECIDE_BATCH:
            batches.append([])
        batches[-1].extend(group)
    random.shuffle(batches)
    return [b for b in batches if b]


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
    """Run-once cron across every replica that runs the same code; see DESIGN §4 and §9.

    Schedules are rows of ``pgcoord.schedules``: those declared in code with
    ``@sched.cron`` (written at ``run()``'s start) and those added at run time
    with ``add()``, which name a handler registered here with ``@sched.job``. A
    replica runs only the schedules whose function it has; the others it leaves
    to replicas that have it. Changes reach a running replica at its next tick
    (at most ``tick`` seconds: each tick reads a change counter), and at once
    with a ``member=`` (NOTIFY on channel ``pgcoord_schedules``).
    """

    def __init__(
        self, source: Any, *, runner: str | None = None, tick: float = 1.0,
        member: Member | None = None, alert_after: int = 3,
    ) -> None:
        check_source(source, need_async=True, background="Scheduler")
        _refuse_shared_connection(source)
        if member is not None and runner is not None:
            raise ValueError("runner= and member= exclude each other: with a member, the runner "
                             "is named after the member")
        if isinstance(alert_after, bool) or not isinstance(alert_after, int) or alert_after < 1:
            raise ValueError(f"alert_after must be an int >= 1, got {alert_after!r}")
        self._source = source
        self._member = member
        self._runner = runner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        #: The jobs declared in code with ``@cron``, by name.
        self.jobs: dict[str, Job] = {}
        self._handlers: dict[str, Handler] = {}
        #: Every schedule this replica runs (code and runtime), as last loaded.
        self._specs: dict[str, Job] = {}
        self._epoch: int | None = None  # the schedules' change counter at the last load
        self._max_sleep = seconds(tick, "tick", minimum=0.01) or 1.0
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
        self._last_recover = 0.0
        self._last_prune = 0.0
        self._last_alert_check = time.monotonic()
        self._alerts = FailingWatch(alert_after)
        self._bad_rows: set[tuple[str, int]] = set()  # rows already logged as unusable
        self._finisher = Finisher(source)

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
        claim_ttl: float = 30.0, keep: float = 30 * 86400.0, timeout: float | None = None,
    ) -> Callable[[JobFn], JobFn]:
        """Register ``fn`` as job ``job`` on cron ``expr`` (5 fields, or 6 with seconds
        first). Its schedule is written to ``pgcoord.schedules`` when ``run()`` starts;
        the code owns it (``update()``/``remove()`` refuse it, ``pause()`` works)."""
        if not isinstance(job, str) or not job:
            raise ValueError("job name must be a non-empty str")
        if job in self.jobs:
            raise ValueError(f"job {job!r} is already registered")
        zone = check_zone(tz)
        check_expr(expr, zone)
        opts = check_options(on_crash=on_crash, max_attempts=max_attempts, catch_up=catch_up,
                             deadline=deadline, allow_overlap=allow_overlap, timeout=timeout)
        handler = self._handler(job, None, transactional, jitter, claim_ttl, keep)
        spec = Job(
            name=job, expr=expr, tz=zone, fn=None,  # type: ignore[arg-type]
            on_crash=opts["on_crash"], max_attempts=opts["max_attempts"],
            catch_up=opts["catch_up"], deadline=opts["deadline"],
            transactional=handler.transactional, allow_overlap=opts["allow_overlap"],
            jitter=handler.jitter, claim_ttl=handler.claim_ttl, keep=handler.keep,
            timeout=opts["timeout"], handler=job,
        )

        def register(fn: JobFn) -> JobFn:
            if not asyncio.iscoroutinefunction(fn):
                raise TypeError(f"job {job!r} must be an async function")
            spec.fn = fn
            self.jobs[job] = spec
            return fn

        return register

    def job(
        self, handler: str, *, transactional: bool = False, jitter: float = 0.0,
        claim_ttl: float = 30.0, keep: float = 30 * 86400.0,
    ) -> Callable[[JobFn], JobFn]:
        """Register ``fn`` as handler ``handler``, with no schedule of its own: the
        schedules added with ``add(..., handler=handler)`` run it, on the replicas
        that register it (and only there)."""
        if not isinstance(handler, str) or not handler:
            raise ValueError("handler name must be a non-empty str")
        if handler in self._handlers:
            raise ValueError(f"handler {handler!r} is already registered")
        spec = self._handler(handler, None, transactional, jitter, claim_ttl, keep)

        def register(fn: JobFn) -> JobFn:
            if not asyncio.iscoroutinefunction(fn):
                raise TypeError(f"handler {handler!r} must be an async function")
            spec.fn = fn
            self._handlers[handler] = spec
            return fn

        return register

    def _handler(self, name: str, fn: JobFn | None, transactional: bool, jitter: float,
                 claim_ttl: float, keep: float) -> Handler:
        if transactional and self._capacity is not None and self._capacity < 2:
            raise UnsupportedConnection(
                f"job {name!r}: a transactional job holds a pool connection for its whole run, "
                "and the scheduler needs another meanwhile to renew the slot's claim; this pool "
                f"lends at most {self._capacity} connection: give it max_size >= 2 "
                "(SQLAlchemy: pool_size + max_overflow >= 2)"
            )
        return Handler(
            fn=fn,  # type: ignore[arg-type]
            transactional=bool(transactional), jitter=seconds(jitter, "jitter") or 0.0,
            claim_ttl=seconds(claim_ttl, "claim_ttl", minimum=0.3) or 30.0,
            keep=seconds(keep, "keep", minimum=1.0) or 30 * 86400.0,
        )

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
        spec = self._specs.get(job) or self.jobs.get(job)
        if spec is None:
            raise ValueError(f"no job named {job!r} on this replica")
        return spec

    async def _handled(self, job: str) -> Job:
        """The schedule ``job`` as this replica runs it, loading the schedules if
        need be (outside ``run()``); ValueError when this replica cannot run it."""
        if job not in self._specs and job not in self.jobs:
            await self._reload()
        spec = self._specs.get(job) or self.jobs.get(job)
        if spec is None:
            raise ValueError(f"no schedule named {job!r} whose handler is registered on this replica")
        return spec

    # -- schedules at run time (DESIGN §9); usable without run() -------------------------

    async def add(self, name: str, expr: str, *, handler: str, tz: str = "UTC",
                  args: Any = None, paused: bool = False, on_crash: str = "skip",
                  max_attempts: int = 3, catch_up: str = "latest", deadline: float | None = None,
                  allow_overlap: bool = False,
                  timeout: float | None = None,  # noqa: ASYNC109 (the job's bound, not this call's)
                  ) -> ScheduleInfo:
        """Add schedule ``name``: run handler ``handler`` on cron ``expr`` in zone ``tz``,
        with ``args`` (JSON) as ``Slot.args``. ValueError if the name is taken."""
        return await _schedules.add(
            self._source, name, expr, handler=handler, tz=tz, args=args, paused=paused,
            on_crash=on_crash, max_attempts=max_attempts, catch_up=catch_up, deadline=deadline,
            allow_overlap=allow_overlap, timeout=timeout)

    async def update(self, name: str, **changes: Any) -> ScheduleInfo:
        """Change any option of ``add()`` (by keyword) of a schedule added at run time.
        A new expr or tz counts slots afresh from now; the old expression's slots
        due before now that no replica recorded yet are recorded missed ('changed')."""
        return await _schedules.update(self._source, name, **changes)

    async def pause(self, name: str) -> None:
        """Pause ``name``: its slots from now on are recorded skipped, reason 'paused'."""
        await _schedules.pause(self._source, name)

    async def resume(self, name: str, *, catch_up: str = "none") -> None:
        """Resume ``name``. ``catch_up="latest"`` runs it once now if a slot was skipped
        while it was paused; ``"none"`` leaves those slots skipped."""
        await _schedules.resume(self._source, name, catch_up=catch_up)

    async def remove(self, name: str) -> None:
        """Remove schedule ``name`` (added at run time). A run in progress finishes and
        is recorded; no further slot starts. Its job_slots rows stay."""
        await _schedules.remove(self._source, name)

    async def schedules(self) -> list[ScheduleInfo]:
        """Every schedule, with its latest run and next slot."""
        return await _schedules.list_all(self._source)

    # -- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Run every due slot of the schedules this replica has handlers for, until ``stop()``."""
        if not self.jobs and not self._handlers:
            raise ValueError("no jobs registered: decorate functions with @scheduler.cron(...) "
                             "or @scheduler.job(...)")
        if self._run_task is not None:
            raise RuntimeError("this Scheduler is already running")
        self._run_task, self._stopping, self._draining = asyncio.current_task(), False, False
        unhook = self._hook_member()
        try:
            await self._register()
            await self._listen()
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
            try:
                await finish_despite_cancel(self._finisher.close(), bound=CLEANUP_TIMEOUT)
            except CleanupTimeout:
                log.warning("scheduler: recording the last runs' ends was abandoned after %.0f s"
                            " (their claims expire)", CLEANUP_TIMEOUT)
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
        self._unlisten: Callable[[], None] = lambda: None

        def unhook() -> None:
            unhook_left()
            unhook_lost()
            self._unlisten()
            for task in tasks:
                task.cancel()

        return unhook

    async def _listen(self) -> None:
        """With a member, hear of schedule changes at once (NOTIFY on its session);
        without one, or behind a pooler, the tick's change counter finds them."""
        member = self._member
        if member is None:
            return

        def changed(_payload: str) -> None:
            self._epoch = None  # reload on the next tick, which starts now
            self._wake.set()

        try:
            self._unlisten = await member.listen(SCHEDULES_CHANNEL, changed)
        except Exception as exc:  # the counter still finds every change
            log.warning("scheduler: cannot LISTEN for schedule changes, polling only: %r", exc)

    async def _expire_claims_of(self, member_id: int) -> None:
        try:
            row = await run_statement(self._source, query("job_expire_member_claims"), (member_id,))
        except Exception as exc:  # the claims still expire on their own
            log.warning("scheduler: expiring the claims of member %d failed: %r", member_id, exc)
            return
        if row is not None and row[0]:
            log.warning("scheduler: member %d is gone; %d running claim(s) of it expired now",
                        member_id, row[0])
            self._last_recover = 0.0  # look for them on this very tick
            self._wake.set()

    async def _register(self) -> None:
        """Write the code's schedules, trying again (backing off) while the database is away."""
        declared = [{"name": s.name, "expr": s.expr, "tz": s.tz.key, "on_crash": s.on_crash,
                     "catch_up": s.catch_up, "deadline": s.deadline, "allow_overlap": s.allow_overlap,
                     "timeout": s.timeout, "max_attempts": s.max_attempts}
                    for s in self.jobs.values()]
        failures = 0
        while not self._draining:
            try:
                row = await run_statement(self._source, query("schedule_declare"),
                                          (json.dumps(declared),))
            except SchemaMissing:
                raise
            except Exception as exc:
                failures += 1
                pause = _backoff(failures)
                log.warning("declaring the code's schedules failed, trying again in %.2f s: %r",
                            pause, exc)
                await self._sleep(pause)
                continue
            assert row is not None
            self._clock_offset = row[0].timestamp() - time.time()
            return

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

    async def _reload(self) -> None:
        """Load every schedule this replica has a handler for; keep what was decided
        of those whose version did not change."""
        row = await run_statement(self._source, query("schedule_load"),
                                  (list(self._handlers), list(self.jobs)))
        assert row is not None
        epoch, now = int(row[0]), _utc(row[1])
        columns = row[2:]
        specs: dict[str, Job] = {}
        if columns[0] is not None:
            for values in zip(*columns, strict=True):
                spec = self._spec_from_row(values, now)
                if spec is not None:
                    specs[spec.name] = spec
        self._specs, self._epoch = specs, epoch

    def _spec_from_row(self, values: tuple[Any, ...], now: dt.datetime) -> Job | None:
        (name, handler_name, expr, tz, args, paused, on_crash, catch_up, deadline, allow_overlap,
         timeout, max_attempts, in_code, since, paused_at, resumed_at, version, last) = values
        version = int(version)
        old = self._specs.get(name)
        if old is not None and old.version == version:
            return old
        handler: Handler | Job | None = self.jobs.get(name) if in_code else self._handlers.get(handler_name)
        if handler is None:
            return None
        try:
            zone = check_zone(tz)
            check_expr(expr, zone)
        except ValueError as exc:  # written by hand in SQL, perhaps: run nothing of it
            if (name, version) not in self._bad_rows:
                self._bad_rows.add((name, version))
                log.error("schedule %r (version %d) cannot run: %s", name, version, exc)
            return None
        since = _utc(since)
        spec = Job(
            name=name, expr=expr, tz=zone, fn=handler.fn, on_crash=on_crash,
            max_attempts=int(max_attempts), catch_up=catch_up,
            deadline=None if deadline is None else float(deadline),
            transactional=handler.transactional, allow_overlap=bool(allow_overlap),
            jitter=handler.jitter, claim_ttl=handler.claim_ttl, keep=handler.keep,
            registered_at=since, timeout=None if timeout is None else float(timeout),
            handler=handler_name, args=json.loads(args), version=version, paused=bool(paused),
            paused_at=None if paused_at is None else _utc(paused_at),
            resumed_at=None if resumed_at is None else _utc(resumed_at), in_code=bool(in_code),
        )
        decided = [since] + ([] if last is None else [_utc(last)])
        if old is not None and old.after is not None:
            decided.append(old.after)
        spec.after = max(decided)
        spec.next_due = spec.next_after(spec.after)
        return spec

    async def tick(self) -> float:
        """One pass over every schedule; returns when (database epoch seconds) to look
        again. Every due schedule is decided in one statement."""
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        now, epoch, owed = _utc(row[0]), int(row[1]), row[2] or []
        self._clock_offset = now.timestamp() - time.time()
        if epoch != self._epoch:
            await self._reload()
        due = [s for s in self._specs.values() if s.next_due is not None and s.next_due <= now]
        plain = [s for s in due if not s.jitter]
        jittered = [s for s in due if s.jitter]
        await asyncio.gather(self._decide(plain, now),
                             *(self._decide_jittered(s) for s in jittered))
        if owed:
            await self._take_owed([self._specs[n] for n in owed if n in self._specs])
        await self._housekeeping()
        wake: float = now.timestamp() + self._max_sleep
        for spec in self._specs.values():
            if spec.next_due is not None:
                wake = min(wake, spec.next_due.timestamp())
        return wake

    async def _decide_jittered(self, spec: Job) -> None:
        await asyncio.sleep(random.uniform(0, spec.jitter))
        await self._decide([spec], dt.datetime.fromtimestamp(self._db_now(), UTC))

    async def _decide(self, specs: list[Job], now: dt.datetime) -> None:
        """Decide the due slots of ``specs`` in one statement: claim those to run,
        record the others missed or skipped; start what this replica claimed."""
        if not specs:
            return
        try:
            runner = self.runner
        except _NotJoined:
            return  # the member is (re)joining: claim nothing until it has
        groups: list[list[_Entry]] = []
        decided: dict[str, dt.datetime] = {}
        for spec in specs:
            todo, last = spec.decide(now)
            on_overlap = ("run" if spec.allow_overlap
                          else "wait" if spec.catch_up == "all" else "skip")
            if on_overlap == "wait":
                # A backlog runs one slot after another: the second run of this
                # batch would only wait, so it and what follows wait for a later tick.
                runs = [at for at, act, _ in todo if act == "run"]
                if len(runs) > 1:
                    todo = [t for t in todo if t[0] < runs[1]]
                    last = runs[1] - _TINY
            ms = int(spec.claim_ttl * 1000)
            if todo:
                groups.append([(spec.name, at, spec.version, act, reason, on_overlap, ms)
                               for at, act, reason in todo])
            decided[spec.name] = last
        by_name = {spec.name: spec for spec in specs}
        waiting: dict[str, dt.datetime] = {}
        stale: set[str] = set()
        for part in _batches(groups):
            sent = time.monotonic()
            row = await run_statement(self._source, query("schedule_decide"), (
                [e[0] for e in part], [e[1] for e in part], [e[2] for e in part],
                [e[3] for e in part], [e[4] for e in part], [e[5] for e in part],
                [e[6] for e in part], runner))
            if row is None or row[0] is None:
                continue
            for job, at, state, attempt in zip(*row, strict=True):
                spec, at = by_name[job], _utc(at)
                if state == "running":
                    self._start(spec, Slot(job, at, int(attempt), args=spec.args), sent, runner)
                elif state == "waiting":
                    waiting[job] = min(at, waiting.get(job, at))
                elif state == "stale":
                    stale.add(job)
                else:
                    log.info("job %r slot %s skipped: the previous run is still going", job, at)
        for spec in specs:
            if spec.name in stale:
                self._epoch = None  # changed under us: reload and decide again
            elif spec.name in waiting:
                spec.after = min(decided[spec.name], waiting[spec.name] - _TINY)
                spec.next_due = waiting[spec.name]
            else:
                spec.after = max(spec.after or decided[spec.name], decided[spec.name])
                spec.next_due = spec.next_after(spec.after)

    async def _take_owed(self, specs: list[Job]) -> None:
        """Runs owed (a trigger from SQL or the CLI, a resume with catch_up latest)."""
        if not specs:
            return
        try:
            runner = self.runner
        except _NotJoined:
            return
        sent = time.monotonic()
        row = await run_statement(self._source, query("schedule_take_owed"), (
            [s.name for s in specs], [int(s.claim_ttl * 1000) for s in specs], runner))
        if row is None or row[0] is None:
            return
        for job, at, attempt in zip(*row, strict=True):
            spec = self._specs[job]
            self._start(spec, Slot(job, _utc(at), int(attempt), manual=True, args=spec.args),
                        sent, runner)

    async def _housekeeping(self) -> None:
        """Expired claims, retention and failure alerts, each now and then; a pass
        that fails is logged and tried again later."""
        specs = list(self._specs.values())
        if not specs:
            return
        clock = time.monotonic()
        if clock - self._last_recover >= min(s.claim_ttl for s in specs) / 3:
            self._last_recover = clock
            try:
                await self._recover(specs)
            except Exception as exc:
                log.warning("scheduler: looking for lost claims failed: %r", exc)
        if clock - self._last_prune > PRUNE_EVERY:
            self._last_prune = clock
            try:
                await self._prune(specs)
            except Exception as exc:
                log.warning("scheduler: retention pass failed: %r", exc)
        if clock - self._last_alert_check > ALERT_EVERY:
            self._last_alert_check = clock
            try:
                await self.check_failing()
            except Exception as exc:
                log.warning("scheduler: looking for failing jobs failed: %r", exc)

    async def _recover(self, specs: list[Job]) -> None:
        try:
            runner = self.runner
        except _NotJoined:
            return
        sent = time.monotonic()
        row = await run_statement(self._source, query("schedule_recover"), (
            [s.name for s in specs], [int(s.claim_ttl * 1000) for s in specs],
            [s.on_crash == "retry" for s in specs], [s.max_attempts for s in specs], runner))
        if row is None or row[0] is None:
            return
        for job, at, attempt in zip(*row, strict=True):
            spec, at = self._specs[job], _utc(at)
            log.warning("job %r slot %s: runner lost, retrying as attempt %d", job, at, attempt)
            self._start(spec, Slot(job, at, int(attempt), args=spec.args), sent, runner)

    async def _prune(self, specs: list[Job], *, batch: int = 1000) -> int:
        total = 0
        while True:
            row = await run_statement(self._source, query("schedule_prune"), (
                [s.name for s in specs], [int(s.keep * 1000) for s in specs], batch))
            deleted = int(row[0]) if row else 0
            total += deleted
            if deleted < batch:
                return total

    async def prune(self, job: str, *, batch: int = 1000) -> int:
        """Delete this job's finished rows older than its ``keep``, in batches; the count."""
        return await self._prune([self._job(job)], batch=batch)

    async def check_failing(self) -> list[str]:
        """The schedules run here (not paused) with no success in their last
        ``alert_after`` expected slots — failed, abandoned, missed or never run.
        Each is logged (a warning when it starts failing, info when it recovers) and
        counted in the gauge ``pgcoord_jobs_failing{handler}``. The loop calls this
        every minute."""
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        now = _utc(row[0])
        watched = [s for s in self._specs.values() if not s.paused]
        return await self._alerts.check(self._source, watched, now)

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
        """Run ``job`` now, on this replica, without using up a scheduled slot. (To have
        any replica that has the handler run it: ``pgcoord jobs trigger NAME``, or
        ``select pgcoord.schedule_trigger(name)``.)"""
        spec = await self._handled(job)
        try:
            runner = self.runner
        except _NotJoined:
            raise PgcoordError("the scheduler's member is not joined (its session is being "
                               "reconnected); trigger again shortly") from None
        sent = time.monotonic()
        row = await run_statement(self._source, query("job_claim_now"),
                                  (spec.name, runner, int(spec.claim_ttl * 1000)))
        assert row is not None
        slot = Slot(spec.name, row[2], int(row[1]), manual=True, args=spec.args)
        await self._execute(_Run(spec, slot, _Claim(spec.claim_ttl, sent), runner))
        return slot

    async def backfill(self, job: str, start: dt.datetime, end: dt.datetime) -> list[Slot]:
        """Run, on this replica and one after another, each slot of ``job`` in
        [start, end] (a past range) that has no row yet; a slot that has one (run,
        missed, skipped — here or by another backfill) keeps it. Returns the slots
        run here."""
        for what, value in (("start", start), ("end", end)):
            if not isinstance(value, dt.datetime) or value.utcoffset() is None:
                raise ValueError(f"backfill {what} must be an aware datetime, got {value!r}")
        if start > end:
            raise ValueError(f"backfill start {start} is after its end {end}")
        spec = await self._handled(job)
        now = await self._database_now()
        if end > now:
            raise ValueError(f"backfill end {end} is in the future (database clock {now}): "
                             "the scheduler runs slots as they come due")
        slots = slots_between(spec.expr, spec.tz, start.astimezone(UTC) - _TINY,
                              end.astimezone(UTC), limit=BACKFILL_MAX + 1)
        if len(slots) > BACKFILL_MAX:
            raise ValueError(f"backfill of {job!r} from {start} to {end} is more than "
                             f"{BACKFILL_MAX} slots; split the range")
        ran: list[Slot] = []
        for at in slots:
            try:
                runner = self.runner
            except _NotJoined:
                raise PgcoordError("the scheduler's member is not joined (its session is being "
                                   "reconnected); backfill again shortly") from None
            sent = time.monotonic()
            claim = await run_statement(self._source, query("job_claim"),
                                        (spec.name, at, runner, int(spec.claim_ttl * 1000), "run"))
            if claim is None or claim[0] != "running":
                continue  # the slot has its row already
            slot = Slot(spec.name, at, int(claim[1]), args=spec.args)
            await self._execute(_Run(spec, slot, _Claim(spec.claim_ttl, sent), runner))
            ran.append(slot)
        return ran

    async def _database_now(self) -> dt.datetime:
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        return _utc(row[0])

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
        outcome, reason, error = self._outcome(run, body, cancelled)
        if outcome is not None:
            await self._record(run, outcome, error, reason)
        if cancelled:
            raise asyncio.CancelledError

    async def _body(self, run: _Run) -> bool:
        """The job itself; True when it recorded its own success (transactional)."""
        if run.spec.transactional:
            return await self._run_transactional(run)
        await _call(run.spec, run.slot)
        return False

    def _outcome(self, run: _Run, body: asyncio.Task[bool], cancelled: bool,
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

    async def _record(self, run: _Run, outcome: str, error: str | None,
                      reason: str | None = None) -> None:
        """Record a run's end, bounded: a record that cannot finish in time (a row lock,
        a server that does not answer) is abandoned and the claim left to expire."""
        spec, slot = run.spec, run.slot
        if outcome == "stopped":
            if spec.on_crash == "retry":
                return  # the claim expires and another replica retries it
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
            return
        except Exception as exc:
            log.warning("job %r slot %s: could not record %s: %r", spec.name, slot.at, outcome, exc)
            return
        if not recorded:
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
