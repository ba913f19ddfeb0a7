"""``Scheduler``: run-once cron across replicas, on ``pgcoord.job_slots``.

Every replica runs the same loop, with no leader. The schedules are rows of
``pgcoord.schedules`` (declared in code with ``@cron``, or added at run time
naming a handler registered with ``@job``); a replica loads those it has a
function for, and keeps each one's next slot in memory. Each tick reads the
database clock and the schedules' change counter (reloading when it moved),
then decides every due slot of every schedule in a few set-based statements
(``schedule_decide``): a claim for each slot to run, a ``missed`` or
``skipped`` row for the others. The table's primary key (job, slot instant)
lets exactly one claim succeed, and that replica runs the slot. Every slot since
a schedule was registered ends as a row in a terminal state with a reason:
succeeded, failed, abandoned, missed or skipped. Cron expressions are evaluated
by cronsim, which follows Debian cron across daylight-saving changes
(``_cron``); a claimed slot runs under a lease-like claim (``_jobrun``).

When a runner dies, its claim expires; with ``on_crash="skip"`` any replica
then records the slot ``abandoned`` (at most once); with ``"retry"`` one
replica takes it over as the next attempt, up to ``max_attempts``.

The loop survives the database: a tick that fails (a lost connection, a
server restart, a terminated session) is logged and tried again after a
back-off; it never ends ``run()``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from . import schedules as _schedules
from ._aio import CLEANUP_TIMEOUT, CleanupTimeout, absorb_cancel, consume_result, finish_despite_cancel
from ._cron import Handler, Job, check_expr, check_zone, next_slot, seconds, slots_between
from ._drivers import check_source, driver_of, run_statement
from ._drivers.capacity import pool_capacity
from ._finisher import Finisher
from ._jobalerts import FailingWatch
from ._jobrun import Claim, NotJoined, Run, Slot, SlotRunner, as_utc
from ._queries import query
from .errors import PgcoordError, SchemaMissing, UnsupportedConnection
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
    if driver_of(source) != "sqlalchemy":
        return
    from sqlalchemy.pool import AssertionPool, StaticPool

    pool = source.sync_engine.pool
    if isinstance(pool, StaticPool | AssertionPool):
        raise UnsupportedConnection(
            f"Scheduler runs statements concurrently and cannot use an engine with a "
            f"{type(pool).__name__}, which lends one connection to every checkout; "
            "use the default pool (AsyncAdaptedQueuePool) or NullPool"
        )


class Scheduler(SlotRunner):
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
        self._running: dict[tuple[str, dt.datetime], Run] = {}
        self._run_task: asyncio.Task[Any] | None = None
        self._stopping = False
        self._draining = False
        self._drain = 30.0
        self._clock_offset = 0.0  # database clock minus local wall clock
        # Seconds this scheduler's ticks run ahead of the database clock: 0, except
        # under pgcoord.testing.advance(), which moves a test's scheduler forward.
        self._time_shift = 0.0
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
            raise NotJoined()
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
            timeout=opts["timeout"], handler=job, args={},
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
        due before now that no replica recorded yet are decided by the schedule's
        catch_up (those it runs are run once, late; the others recorded missed,
        reason 'changed')."""
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
        declaring: asyncio.Task[None] | None = None
        try:
            declaring = await self._register()
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
            if declaring is not None:
                declaring.cancel()
                declaring.add_done_callback(consume_result)
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
                    cut = asyncio.ensure_future(self._insist(run, run.body))
                    tasks.add(cut)
                    cut.add_done_callback(tasks.discard)
                    cut.add_done_callback(consume_result)
            # A change notified while the session is away is lost: tick (and read
            # the change counter) as soon as the member listens again, not at the
            # next tick, which may be `tick` seconds away.
            task = asyncio.ensure_future(self._wake_when_rejoined(member, old_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(consume_result)

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

    async def _wake_when_rejoined(self, member: Member, old_id: int) -> None:
        while True:
            await member.wait_joined()  # set again after the new session's LISTENs
            if member.id is not None and member.id != old_id:
                break
            await asyncio.sleep(0.05)  # still the old session's flag: not cleared yet
        self._wake.set()

    async def _listen(self) -> None:
        """With a member, hear of schedule changes at once (NOTIFY on its session);
        without one, or behind a pooler, the tick's change counter finds them."""
        member = self._member
        if member is None:
            return

        def changed(_payload: str) -> None:
            # Tick now. The tick reads the change counter (committed before the
            # notification is delivered) and reloads only if it moved: a run owed
            # (payload 'owed') or a change already seen loads nothing.
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

    async def _register(self) -> asyncio.Task[None] | None:
        """Write the code's schedules. If that fails (the database away, or a lock
        held by a transaction that changed these rows and is still open:
        schedule_declare waits 1 s at most), the loop starts anyway, running the
        schedules there are, and a task (returned; run() owns it) tries again,
        backing off, and reloads once it is done."""
        if not self.jobs:
            return None
        try:
            await self._declare()
        except SchemaMissing:
            raise
        except Exception as exc:
            log.warning("declaring the code's schedules failed; running the schedules there are"
                        " and trying again: %r", exc)
            return asyncio.create_task(self._declare_again(), name="pgcoord-scheduler-declare")
        return None

    async def _declare(self) -> None:
        declared = [{"name": s.name, "expr": s.expr, "tz": s.tz.key, "on_crash": s.on_crash,
                     "catch_up": s.catch_up, "deadline": s.deadline, "allow_overlap": s.allow_overlap,
                     "timeout": s.timeout, "max_attempts": s.max_attempts}
                    for s in self.jobs.values()]
        row = await run_statement(self._source, query("schedule_declare"), (json.dumps(declared),))
        assert row is not None
        self._clock_offset = row[0].timestamp() - time.time()

    async def _declare_again(self) -> None:
        failures = 0
        while not self._draining:
            failures += 1
            await asyncio.sleep(_backoff(failures))
            try:
                await self._declare()
            except Exception as exc:
                log.warning("declaring the code's schedules failed (%d in a row): %r", failures, exc)
                continue
            self._epoch = None  # load what was declared at the next tick, now
            self._wake.set()
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
        epoch, now = int(row[0]), as_utc(row[1])
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
        since = as_utc(since)
        spec = Job(
            name=name, expr=expr, tz=zone, fn=handler.fn, on_crash=on_crash,
            max_attempts=int(max_attempts), catch_up=catch_up,
            deadline=None if deadline is None else float(deadline),
            transactional=handler.transactional, allow_overlap=bool(allow_overlap),
            jitter=handler.jitter, claim_ttl=handler.claim_ttl, keep=handler.keep,
            registered_at=since, timeout=None if timeout is None else float(timeout),
            handler=handler_name, args=json.loads(args), version=version, paused=bool(paused),
            paused_at=None if paused_at is None else as_utc(paused_at),
            resumed_at=None if resumed_at is None else as_utc(resumed_at), in_code=bool(in_code),
        )
        decided = [since] + ([] if last is None else [as_utc(last)])
        if old is not None and old.after is not None:
            decided.append(old.after)
        spec.after = max(decided)
        spec.next_due = spec.next_after(spec.after)
        return spec

    async def tick(self) -> float:
        """One pass over every schedule; returns when (database epoch seconds) to look
        again. The due slots of all schedules are decided together, in batches."""
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        now, epoch = as_utc(row[0]) + dt.timedelta(seconds=self._time_shift), int(row[1])
        owed = [] if row[2] is None else list(zip(row[2], row[3], row[4], row[5], strict=True))
        self._clock_offset = now.timestamp() - time.time()
        # A reload (of every schedule: ~0.2 s for 10,000) comes after this tick's
        # decisions, not before, so that a stream of changes does not hold up the
        # slots of the schedules that did not change. Deciding under the versions
        # loaded is safe: a claim for a schedule changed since comes back stale,
        # inserts nothing, and its slots are decided again at once after the reload.
        if self._epoch is None:
            await self._reload()
        await self._decide_due(now)
        if epoch != self._epoch:
            await self._reload()
            # Only the schedules that changed (or were stale) can be due now.
            await self._decide_due(now)
        if owed:
            # A failure here (a missing grant, a lost connection) must not cost the
            # tick its housekeeping: recovery, retention and alerts still run.
            try:
                await self._take_owed(owed)
            except Exception as exc:
                log.warning("scheduler: taking owed runs failed: %r", exc)
        await self._housekeeping()
        wake: float = now.timestamp() + self._max_sleep
        for spec in self._specs.values():
            if spec.next_due is not None:
                wake = min(wake, spec.next_due.timestamp())
        return wake

    async def _decide_due(self, now: dt.datetime) -> None:
        due = [s for s in self._specs.values() if s.next_due is not None and s.next_due <= now]
        plain = [s for s in due if not s.jitter]
        jittered = [s for s in due if s.jitter]
        await asyncio.gather(self._decide(plain, now),
                             *(self._decide_jittered(s) for s in jittered))

    async def _decide_jittered(self, spec: Job) -> None:
        await asyncio.sleep(random.uniform(0, spec.jitter))
        await self._decide([spec], dt.datetime.fromtimestamp(self._db_now(), UTC))

    async def _decide(self, specs: list[Job], now: dt.datetime) -> None:
        """Decide the due slots of ``specs`` in a statement per DECIDE_BATCH: claim those
        to run, record the others missed or skipped; start what this replica claimed. A
        failed batch fails the tick; the next one decides those slots again (a slot
        claimed meanwhile by anyone is not claimed twice: the primary key)."""
        if not specs:
            return
        try:
            runner = self.runner
        except NotJoined:
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
                spec, at = by_name[job], as_utc(at)
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

    async def _take_owed(self, owed: list[tuple[str, Any, Any, Any]]) -> None:
        """Runs owed (a trigger from SQL or the CLI, a resume with catch_up latest) of
        the schedules run here. A resume's run is owed only if the expression fired
        in the pause (slot_after, slot_until]; if not, the row is dropped unrun."""
        mine = [(self._specs[name], at, after, until) for name, at, after, until in owed
                if name in self._specs]
        if not mine:
            return
        try:
            runner = self.runner
        except NotJoined:
            return
        runs = [after is None or until is None
                or next_slot(spec.expr, spec.tz, as_utc(after)) <= as_utc(until)
                for spec, _, after, until in mine]
        sent = time.monotonic()
        row = await run_statement(self._source, query("schedule_take_owed"), (
            [m[0].name for m in mine], [m[1] for m in mine], runs,
            [int(m[0].claim_ttl * 1000) for m in mine], runner))
        if row is None or row[0] is None:
            return
        by_name = {m[0].name: m[0] for m in mine}  # not self._specs: a reload may replace it
        for job, at, attempt, manual in zip(*row, strict=True):
            spec = by_name[job]
            self._start(spec, Slot(job, as_utc(at), int(attempt), manual=bool(manual),
                                   args=spec.args), sent, runner)

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
        except NotJoined:
            return
        sent = time.monotonic()
        row = await run_statement(self._source, query("schedule_recover"), (
            [s.name for s in specs], [int(s.claim_ttl * 1000) for s in specs],
            [s.on_crash == "retry" for s in specs], [s.max_attempts for s in specs], runner))
        if row is None or row[0] is None:
            return
        by_name = {s.name: s for s in specs}  # not self._specs: a reload may replace it
        for job, at, attempt in zip(*row, strict=True):
            spec, at = by_name[job], as_utc(at)
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
        """The schedules (not paused; whoever runs them, so one whose handler no
        replica registers counts) with no success in their last ``alert_after``
        expected slots since they were added, re-expressed or resumed — failed,
        abandoned, missed or never run. Each is logged (a warning when it starts
        failing, info when it recovers) and counted in the gauge
        ``pgcoord_jobs_failing{handler}``. The loop calls this every minute."""
        return await self._alerts.check(self._source)

    # -- running slots ---------------------------------------------------------------------

    async def trigger(self, job: str) -> Slot:
        """Run ``job`` now, on this replica, without using up a scheduled slot. (To have
        any replica that has the handler run it: ``pgcoord jobs trigger NAME``, or
        ``select pgcoord.schedule_trigger(name)``.)"""
        spec = await self._handled(job)
        try:
            runner = self.runner
        except NotJoined:
            raise PgcoordError("the scheduler's member is not joined (its session is being "
                               "reconnected); trigger again shortly") from None
        sent = time.monotonic()
        row = await run_statement(self._source, query("job_claim_now"),
                                  (spec.name, runner, int(spec.claim_ttl * 1000)))
        assert row is not None
        slot = Slot(spec.name, row[2], int(row[1]), manual=True, args=spec.args)
        await self._execute(Run(spec, slot, Claim(spec.claim_ttl, sent), runner))
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
            except NotJoined:
                raise PgcoordError("the scheduler's member is not joined (its session is being "
                                   "reconnected); backfill again shortly") from None
            sent = time.monotonic()
            claim = await run_statement(self._source, query("job_claim"),
                                        (spec.name, at, runner, int(spec.claim_ttl * 1000), "run"))
            if claim is None or claim[0] != "running":
                continue  # the slot has its row already
            slot = Slot(spec.name, at, int(claim[1]), args=spec.args)
            await self._execute(Run(spec, slot, Claim(spec.claim_ttl, sent), runner))
            ran.append(slot)
        return ran

    async def _database_now(self) -> dt.datetime:
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        return as_utc(row[0])
