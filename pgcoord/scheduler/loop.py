"""``Scheduler``: the object users hold, and its loop (the package's docstring
tells the whole story).

The loop is the scheduler's own: ``run()`` declares the code's schedules, then
ticks until ``stop()``. A tick reads the database clock and the schedules'
change counter (``store``), reloads the schedules when it moved (``registry``),
decides what is due (``plan``) and claims it (``claims``), the slots won
running beside the loop (``runs``); now and then it looks for lost claims,
prunes old rows and looks for schedules that keep failing (``alerts``). A tick
that fails is logged and tried again after a back-off; it never ends ``run()``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._core import readonly
from .._core.aio import (
    CLEANUP_TIMEOUT,
    CleanupTimeout,
    Supervisor,
    absorb_cancel,
    consume_result,
    finish_despite_cancel,
)
from .._core.checks import count, seconds, text
from .._drivers import check_source
from .._drivers.capacity import pool_capacity
from ..errors import PgcoordError, SchemaMissing
from . import plan

# pgcoord.schedules imports scheduler.cron: read from it at call time only, so that
# either may be imported first.
from . import schedules as _schedules
from .alerts import FailingWatch
from .claims import Claims
from .cron import Job
from .jitter import Jitters
from .membership import MemberLink
from .own_member import OwnMember
from .registry import JobFn, Registry
from .runner import NotJoined, Slot
from .runs import Runs
from .store import Store, refuse_shared_connection

if TYPE_CHECKING:
    from ..member import Member
    from .schedules import ScheduleInfo

__all__ = ["Scheduler"]

log = logging.getLogger("pgcoord.scheduler")

UTC = dt.UTC
PRUNE_EVERY = 300.0  # seconds between retention passes of one replica
ALERT_EVERY = 60.0  # seconds between looks for schedules that keep failing
ALERT_AFTER_MAX = 10_000
NEXT_RUNS_MAX = 100_000


class Scheduler:
    """Run-once cron across every replica that runs the same code (docs/scheduler.md, docs/schedules.md).

    Schedules are rows of ``pgcoord.schedules``: those declared in code with
    ``@sched.cron`` (written at ``run()``'s start) and those added at run time
    with ``add()``, which name a handler registered here with ``@sched.job``. A
    replica runs only the schedules whose function it has; the others it leaves
    to replicas that have it. Changes reach a running replica at its next tick
    (at most ``tick`` seconds: each tick reads a change counter), and at once
    with a ``member=`` and a tick longer than a second (NOTIFY on channel
    ``pgcoord_schedules``).
    """

    def __init__(
        self, source: Any, *, runner: str | None = None, tick: float = 1.0,
        member: Member | None = None, alert_after: int = 3,
    ) -> None:
        check_source(source, need_async=True, background="Scheduler")
        refuse_shared_connection(source)
        if member is not None and runner is not None:
            raise ValueError("runner= and member= exclude each other: with a member, the runner "
                             "is named after the member")
        # Each check walks back alert_after slots of every schedule: bounded.
        count(alert_after, "alert_after", maximum=ALERT_AFTER_MAX)
        if runner is not None:
            text(runner, "runner")  # stored in job_slots.runner
        max_sleep = seconds(tick, "tick", minimum=0.01) or 1.0
        capacity = pool_capacity(source)
        self._source = source
        self._member = member
        self._runner = runner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # The parts: what runs here, the statements, the runs and their claims.
        self._registry = Registry(capacity)
        self._store = Store(source, self._tick_member)
        self._wake = asyncio.Event()  # set: the loop ticks now
        self._runs = Runs(source, capacity, self._wake)
        self._claims = Claims(self._store, self._runs)
        self._member_link = MemberLink(member, self._runs, self._store, self._wake, self._recover_soon)
        # The README's form (neither member= nor runner=) ties its claims to a
        # member of its own during run() (own_member.py).
        self._own = OwnMember(source, self._runner) if member is None and runner is None else None
        self._alerts = FailingWatch(alert_after)
        self._jitters = Jitters(self._decide_jittered, self._wake)
        # Recovery, retention and alerts: one pass at a time, beside the loop (a
        # retention pass over 10,000 schedules takes seconds; no tick waits for it).
        self._chores = Supervisor("scheduler housekeeping", log)
        self._chore_tasks: dict[str, asyncio.Task[None]] = {}
        # The loop's state.
        #: Every schedule this replica runs (code and runtime), as last loaded.
        self._specs: dict[str, Job] = {}
        self._epoch: int | None = None  # the schedules' change counter at the last load
        self._max_sleep = max_sleep
        self._run_task: asyncio.Task[Any] | None = None
        self._draining = False
        self._stop_pending = False  # stop() before run(): the next run() returns at once
        self._drain = 30.0
        # The last tick's database clock (epoch seconds) and the monotonic clock when
        # it was read: the loop sleeps from there, and never works out the database's
        # time from the local wall clock.
        self._ticked = (0.0, 0.0)
        # Seconds this scheduler's ticks run ahead of the database clock: 0, except
        # under pgcoord.testing.advance(), which moves a test's scheduler forward.
        self._time_shift = 0.0
        self._last_recover = 0.0
        self._last_prune = 0.0
        self._min_ttl = 30.0  # the shortest claim_ttl of the schedules loaded
        self._last_alert_check = time.monotonic()

    @property
    def jobs(self) -> dict[str, Job]:
        """The jobs declared in code with ``@cron``, by name."""
        return self._registry.jobs

    @property
    def runner(self) -> str:
        """The name this replica's claims carry. With a member it is
        ``<member name>/<member id>``: claims are tied to the member's session, so
        when that ends every replica expires them at once (and this replica stops
        the bodies that ran under them)."""
        member = self._member or (self._own.member if self._own is not None else None)
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
        return self._registry.cron(
            job, expr, tz=tz, on_crash=on_crash, max_attempts=max_attempts, catch_up=catch_up,
            deadline=deadline, transactional=transactional, allow_overlap=allow_overlap,
            jitter=jitter, claim_ttl=claim_ttl, keep=keep, timeout=timeout)

    def job(
        self, handler: str, *, transactional: bool = False, jitter: float = 0.0,
        claim_ttl: float = 30.0, keep: float = 30 * 86400.0,
    ) -> Callable[[JobFn], JobFn]:
        """Register ``fn`` as handler ``handler``, with no schedule of its own: the
        schedules added with ``add(..., handler=handler)`` run it, on the replicas
        that register it (and only there)."""
        return self._registry.job(handler, transactional=transactional, jitter=jitter,
                                  claim_ttl=claim_ttl, keep=keep)

    def next_runs(self, job: str, n: int = 5, *, after: dt.datetime | None = None) -> list[dt.datetime]:
        """The next ``n`` scheduled instants of ``job`` (aware, UTC)."""
        count(n, "n", minimum=0, maximum=NEXT_RUNS_MAX)
        if after is not None and (not isinstance(after, dt.datetime) or after.utcoffset() is None):
            raise ValueError(f"after must be an aware datetime, got {after!r}")
        return plan.upcoming(self._job(job), after or dt.datetime.now(UTC), n)

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

    # -- schedules at run time (docs/schedules.md); usable without run() -------------------------

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
        if not self.jobs and not self._registry.handlers:
            raise ValueError("no jobs registered: decorate functions with @scheduler.cron(...) "
                             "or @scheduler.job(...)")
        if self._run_task is not None:
            raise RuntimeError("this Scheduler is already running")
        if self._stop_pending:  # stop() came first (a shutdown before the start): it holds
            self._stop_pending = False
            return
        self._run_task, self._draining = asyncio.current_task(), False
        self._runs.stopping = False
        unhook = self._member_link.hook()
        own_unhook: list[Callable[[], None]] = []

        async def own_joined(member: Member) -> None:
            link = MemberLink(member, self._runs, self._store, self._wake, self._recover_soon)
            own_unhook.append(link.hook())
            await link.listen(self._max_sleep)

        declaring: asyncio.Task[None] | None = None
        try:
            if self._own is not None:
                await self._own.open(own_joined)
            declaring = await self._register()
            await self._member_link.listen(self._max_sleep)
            failures = 0
            while not self._draining:
                self._wake.clear()
                try:
                    wake = await self.tick()
                except Exception as exc:  # the database went away: back off, never end run()
                    failures += 1
                    pause = plan.backoff(failures)
                    readonly.retrying(log, exc, "scheduler tick failed (%d in a row), trying again "
                                      "in %.2f s: %r", failures, pause, exc,
                                      key=f"scheduler:{id(self)}")
                else:
                    failures = 0
                    readonly.writable(f"scheduler:{id(self)}")
                    db_now, read_at = self._ticked
                    pause = max(0.0, min(wake - db_now - (time.monotonic() - read_at), self._max_sleep))
                await self._sleep(pause)
            # Draining: no more claims (a jittered decision already sent is let finish,
            # and its runs with the others); let running slots finish for a while.
            await self._jitters.stop()
            await self._chores.stop()
            running = self._runs.tasks()
            if running:
                await asyncio.wait(running, timeout=self._drain)
        except asyncio.CancelledError:
            if not self._runs.stopping:
                raise
            absorb_cancel()
        finally:
            readonly.forget(f"scheduler:{id(self)}")  # retries no more: not waited for
            try:
                unhook()
                if declaring is not None:
                    declaring.cancel()
                    declaring.add_done_callback(consume_result)
                await self._jitters.stop()
                await self._chores.stop()
                await self._runs.close()
            finally:
                # Also when stop() ran out of patience and cancelled the above: a private
                # member left open would hold the claims of runs left behind for ever.
                for own in own_unhook:
                    own()
                try:
                    if self._own is not None:
                        await finish_despite_cancel(self._own.close(), bound=CLEANUP_TIMEOUT)
                except CleanupTimeout:
                    log.warning("scheduler: closing its private member took over %.0f s; left "
                                "to close in the background", CLEANUP_TIMEOUT)
                finally:
                    self._run_task = None

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
        # A changed expression first, as update() changes one: counted from the change.
        await _schedules.redeclare(self._source, self.jobs.values())
        await self._store.declare(self._registry.declared())

    async def _declare_again(self) -> None:
        failures = 0
        while not self._draining:
            failures += 1
            await asyncio.sleep(plan.backoff(failures))
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
        cancel the rest (recorded abandoned; a retry job's slot is left to another replica).
        Called before ``run()`` has started (a shutdown that comes first), it holds: the
        next ``run()`` returns at once."""
        seconds(drain, "drain")
        task = self._run_task
        if task is None:
            # Not running yet (or a task made to run it has not started): the next
            # run() returns at once rather than going on for ever.
            self._stop_pending = True
            return
        self._drain = drain
        self._draining = True
        self._wake.set()
        # run()'s own cleanup is bounded: the runs stopped (2 x CLEANUP_TIMEOUT), their
        # last records (one more), the private member closed (one more).
        done, _ = await asyncio.wait({task}, timeout=drain + 4 * CLEANUP_TIMEOUT)
        self._runs.stopping = True
        if not done:
            task.cancel()
            await asyncio.wait({task})

    async def _now(self) -> dt.datetime:
        """The database clock (moved on by ``pgcoord.testing.advance()``)."""
        return await self._store.now() + dt.timedelta(seconds=self._time_shift)

    async def _reload(self) -> None:
        """Load every schedule this replica has a handler for; keep what was decided
        of those whose version did not change. Once loaded, a reload reads the
        versions and loads only the schedules whose version moved (or that are new):
        one change costs one schedule's row, not all of them (~0.14 s for 10,000)."""
        handlers, jobs = list(self._registry.handlers), list(self.jobs)
        loaded = self._specs
        names: list[str] | None = None
        if loaded:
            epoch, versions = await self._store.versions(handlers, jobs)
            # A schedule removed and added again has version 1 again, from a new since.
            names = [name for name, (version, since) in versions.items()
                     if (old := loaded.get(name)) is None or old.version != version
                     or old.registered_at != since]
            kept = {name: loaded[name] for name in versions if name in loaded and name not in names}
        rows: list[tuple[Any, ...]] = []
        if names is None:
            epoch, rows = await self._store.load(handlers, jobs)
        elif names:
            # The counter stays the versions' (the older): a change made between the
            # two statements moves it past, and the next tick loads that one too.
            _, rows = await self._store.load(handlers, jobs, names)
        specs: dict[str, Job] = {} if names is None else kept
        for values in rows:
            spec = self._registry.spec_from_row(values, loaded)
            if spec is not None:
                specs[spec.name] = spec
        self._specs, self._epoch = specs, epoch
        self._min_ttl = min((s.claim_ttl for s in specs.values()), default=30.0)

    async def tick(self) -> float:
        """One pass over every schedule; returns when (database epoch seconds) to look
        again. The due slots of all schedules are decided together, in batches."""
        now, epoch, owed = await self._store.clock()
        now += dt.timedelta(seconds=self._time_shift)
        self._ticked = (now.timestamp(), time.monotonic())
        # A reload (of the schedules whose version moved; all of them at the start:
        # ~0.5 s for 10,000) comes after this tick's decisions, not before, so that a
        # stream of changes does not hold up the slots of the schedules that did not
        # change. Deciding under the versions
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
                readonly.retrying(log, exc, "scheduler: taking owed runs failed: %r", exc)
        await self._do_housekeeping()
        if self._claimant() is None:
            # Nothing is decided while the member (re)joins, so a due slot stays due:
            # waking for it would spin. The member's rejoining wakes the loop.
            return now.timestamp() + self._max_sleep
        # Not for a schedule whose jitter wait is on (its task decides it and wakes
        # the loop) nor one whose next slot waits for a run still going (the run's
        # end wakes the loop): their next_due is past, and would spin it.
        # Nor one whose previous run's end is being recorded (the record wakes it).
        waiting, recording = self._claims.waiting, self._runs.recording()
        specs: Iterable[Job] = self._specs.values()
        if waiting or recording or len(self._jitters):
            specs = [s for s in specs
                     if not self._jitters.busy(s.name) and waiting.get(s.name) != s.next_due
                     and not (s.name in recording and s.next_due is not None and s.next_due <= now)]
        return plan.next_wake(specs, now, self._max_sleep)

    async def _decide_due(self, now: dt.datetime) -> None:
        """Decide what is due now; a jittered schedule's slots are decided by a task of
        its own after its wait (``jitter``), never in the tick."""
        plain, jittered = plan.due(self._specs.values(), now)
        # A job that must not overlap whose last run here has ended, but whose end is
        # not recorded yet (a slow statement, a row lock), is decided after the record
        # is in: deciding it now would find the slot still running and skip the next one.
        recording = self._runs.recording()
        if recording:
            plain = [s for s in plain if s.allow_overlap or s.name not in recording]
        await self._decide(plain, now)
        for spec in jittered:
            self._jitters.start(spec)

    async def _decide_jittered(self, name: str) -> None:
        """After its jitter wait: decide what of schedule ``name`` is due, on the
        database clock as it is now (the schedule as last loaded: it may have changed
        or gone during the wait)."""
        spec = self._specs.get(name)
        if self._draining or spec is None or not spec.jitter:
            return
        if not spec.allow_overlap and (ended := self._runs.recording().get(name)):
            # As in a tick: after the last run's record, which is bounded.
            await asyncio.wait(ended)
            spec = self._specs.get(name)
            if self._draining or spec is None or not spec.jitter:
                return
        now = await self._now()
        if spec.next_due is not None and spec.next_due <= now:
            await self._decide([spec], now)

    async def _decide(self, specs: list[Job], now: dt.datetime) -> None:
        """Decide the due slots of ``specs`` (``Claims.decide``), unless the member is
        rejoining; a failed batch fails the tick."""
        runner = self._claimant()
        if specs and runner is not None and await self._claims.decide(specs, now, runner):
            self._epoch = None  # changed under us: reload and decide again

    async def _take_owed(self, owed: list[tuple[str, Any, Any, Any]]) -> None:
        """Runs owed (a trigger from SQL or the CLI, a resume with catch_up latest) of
        the schedules run here. A resume's run is owed only if the expression fired
        in the pause (slot_after, slot_until]; if not, the row is dropped unrun."""
        mine = [(self._specs[name], at, after, until) for name, at, after, until in owed
                if name in self._specs]
        runner = self._claimant()
        if mine and runner is not None:
            await self._claims.take_owed(mine, runner)

    async def _do_housekeeping(self) -> None:
        """Recovery of expired claims, retention and failure alerts, each now and then.
        Each runs in a task of its own, one pass at a time, so that no tick waits for
        it (a retention pass over 10,000 schedules took a tick 7.6 s) and a long one
        does not hold up another (recovery after a member left); a chore whose last
        pass still goes on waits for a later tick. Called on its own, ``tick()`` does
        them before it returns."""
        if not self._specs:
            return
        clock = time.monotonic()
        chores: list[tuple[str, str, float, Callable[[list[Job]], Awaitable[Any]]]] = [
            ("_last_recover", "looking for lost claims", self._min_ttl / 3, self._recover),
            ("_last_prune", "retention pass", PRUNE_EVERY, self._store.prune),
            ("_last_alert_check", "looking for failing jobs", ALERT_EVERY,
             lambda _: self.check_failing()),
        ]
        for last, what, every, work in chores:
            if clock - getattr(self, last) < every:
                continue
            inline = self._run_task is not asyncio.current_task()
            if not inline and (task := self._chore_tasks.get(what)) is not None and not task.done():
                continue
            setattr(self, last, clock)
            if inline:
                await self._chore(what, work)
            else:
                self._chore_tasks[what] = self._chores.spawn(
                    self._chore(what, work), f"pgcoord-scheduler-chore:{what}")

    async def _chore(self, what: str, work: Callable[[list[Job]], Awaitable[Any]]) -> None:
        """One chore's pass over the schedules loaded; a pass that fails is logged and
        tried again at its next turn."""
        try:
            await work(list(self._specs.values()))
        except Exception as exc:
            readonly.retrying(log, exc, "scheduler: %s failed: %r", what, exc)

    async def _recover(self, specs: list[Job]) -> None:
        runner = self._claimant()
        if runner is not None:
            await self._claims.recover(specs, runner)

    def _recover_soon(self) -> None:
        self._last_recover = 0.0  # the next tick looks for lost claims

    def _tick_member(self) -> Member | None:
        """The member whose session reads the tick: ``member=``, or the private one."""
        if self._member is not None:
            return self._member
        return self._own.member if self._own is not None else None

    def _claimant(self) -> str | None:
        """The runner name to claim slots under; None while the member is (re)joining:
        claim nothing until it has."""
        try:
            return self.runner
        except NotJoined:
            return None

    async def prune(self, job: str, *, batch: int = 1000) -> int:
        """Delete this job's finished rows older than its ``keep``, in batches; the count."""
        count(batch, "batch")
        return await self._store.prune([self._job(job)], batch=batch)

    async def check_failing(self) -> list[str]:
        """The schedules (not paused; whoever runs them, so one whose handler no
        replica registers counts) with no success in their last ``alert_after``
        expected slots since they were added, re-expressed or resumed — failed,
        abandoned, missed or never run (a run that ended in their span and
        succeeded counts as a success; a run of one of them still going clears the
        schedule unless the latest run that ended failed). Each is logged (a
        warning when it starts failing, info when it recovers) and counted in the
        gauge ``pgcoord_jobs_failing{handler}``. The loop calls this every minute."""
        return await self._alerts.check(self._source)

    # -- running slots ---------------------------------------------------------------------

    async def trigger(self, job: str) -> Slot:
        """Run ``job`` now, on this replica, without using up a scheduled slot. (To have
        any replica that has the handler run it: ``pgcoord jobs trigger NAME``, or
        ``select pgcoord.schedule_trigger(name)``.)"""
        spec = await self._handled(job)
        return await self._claims.run_now(spec, self._joined_runner("trigger"))

    async def backfill(self, job: str, start: dt.datetime, end: dt.datetime) -> list[Slot]:
        """Run, on this replica and one after another, each slot of ``job`` in
        [start, end] (a past range) that has no row yet; a slot that has one (run,
        missed, skipped — here or by another backfill) keeps it. Returns the slots
        run here."""
        plan.check_range(start, end)
        spec = await self._handled(job)
        ran: list[Slot] = []
        for at in plan.backfill_slots(spec, start, end, await self._database_now()):
            slot = await self._claims.run_slot(spec, at, self._joined_runner("backfill"))
            if slot is not None:
                ran.append(slot)
        return ran

    def _joined_runner(self, what: str) -> str:
        try:
            return self.runner
        except NotJoined:
            raise PgcoordError("the scheduler's member is not joined (its session is being "
                               f"reconnected); {what} again shortly") from None

    async def _database_now(self) -> dt.datetime:
        return await self._store.now()
