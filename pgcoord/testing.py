"""``pgcoord.testing``: make code that uses pgcoord face its failures in tests.

With ``pgcoord[testing]`` installed, pytest loads pgcoord's plugin (entry point
``pytest11``, module ``pgcoord_pytest``, which imports nothing until a test asks
for one of its fixtures):

* ``pgcoord_dsn``: the URL of a throwaway database with pgcoord's schema installed,
  one per test (made from a template, so each costs a ``CREATE DATABASE``). The
  server is ``PGCOORD_TEST_DSN`` (a superuser URL) when set, else one started from
  the PostgreSQL binaries on the machine for the session (as the ``postgres``
  user when the tests run as root, since initdb refuses root).
* ``pgcoord_server``: that server's connection parameters (a dict).

And helpers that make a service's elected, leased or locked code face the
failures it must survive, deterministically:

* ``await take_leadership(dsn, name)``: an outsider takes lease ``name`` now; a
  leader of yours loses it at its next renewal and its fence is stale at once,
  followers of yours stay followers. ``await release_leadership(dsn, name)``
  hands it back to your electors.
* ``await lose_session(dsn, obj)``: the server session behind an ``Elector``,
  ``Member`` or ``LockHolder`` is terminated (``pg_terminate_backend``), as when a
  connection dies: locks held on it are lost, a leader on it steps down.
* ``pause(seconds)``: this process stops for ``seconds`` (its event loop included),
  as in a long GC pause or a SIGSTOP; ``pause_past_ttl(obj)`` pauses just past the
  ttl of an ``Elector`` or ``Member``, long enough for the server to end its
  silent session and for another replica to take over.
* ``await run_slot(sched, job, at)``: run slot ``at`` of ``job`` (a due or past
  instant of its schedule) now, on this replica, exactly as the scheduler would:
  claimed in ``pgcoord.job_slots``, run, recorded; returns the ``Slot``.
* ``await advance(sched, to)``: move a ``Scheduler``'s clock forward to the instant
  ``to`` and tick once: every slot due by then is decided as after such a jump in
  time (run, or recorded ``missed``/``skipped`` per the job's ``catch_up``), and the
  runs started are awaited. Later ticks keep the advanced clock.
* ``await wait_until(predicate, within)``: poll a condition, for asserting
  what your code did afterwards.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ._core.queries import query
from ._drivers.dedicated import DsnSource

__all__ = [
    "OUTSIDER",
    "advance",
    "lose_session",
    "pause",
    "pause_past_ttl",
    "release_leadership",
    "run_slot",
    "take_leadership",
    "wait_until",
]

OUTSIDER = "pgcoord.testing"


# -- failures on demand -------------------------------------------------------------------


async def _run(dsn: str, name: str, *args: Any) -> Any:
    conn = await DsnSource(dsn, None, keepalive=5.0).open()
    try:
        return await conn.fetchval(query(name), *args)
    finally:
        await conn.close_now()


async def take_leadership(dsn: str, name: str, *, holder: str = OUTSIDER, ttl: float = 3600.0) -> int:
    """An outsider takes lease ``name`` now, whoever holds it; returns its fence.

    Your leader's fence is stale from this moment (``check_fence`` raises), and it
    steps down at its next renewal (``LeaseLost``); your followers stay followers
    until ``release_leadership``."""
    return int(await _run(dsn, "testing_take_lease", name, holder, int(ttl * 1000)))


async def release_leadership(dsn: str, name: str, *, holder: str = OUTSIDER) -> bool:
    """The outsider gives lease ``name`` up: your electors campaign at once."""
    return bool(await _run(dsn, "testing_release_lease", name, holder))


def _unwrap(obj: Any) -> Any:
    """The async object behind a ``pgcoord.sync`` twin (the object itself otherwise)."""
    from .sync._twins import _Twin

    return obj._async if isinstance(obj, _Twin) else obj


def _backend_pid(obj: Any) -> int:
    from .elector.elector import Elector
    from .holder.holder import LockHolder
    from .member import Member

    obj = _unwrap(obj)
    pid: Any = None
    if isinstance(obj, Member):
        main = obj._main
        pid = None if main is None else main.backend_pid
    elif isinstance(obj, Elector):
        member = obj._member
        if member is not None:
            return _backend_pid(member)
        conn = obj._conn
        pid = None if conn is None else conn.backend_pid
    elif isinstance(obj, LockHolder):
        pid = obj.backend_pid
    else:
        raise TypeError("lose_session takes an Elector, a Member or a LockHolder (or their "
                        f"pgcoord.sync twins), not {type(obj).__name__}")
    if not isinstance(pid, int):
        raise RuntimeError(f"{type(obj).__name__} has no session right now (not started, or reconnecting)")
    return pid


async def lose_session(dsn: str, obj: Any) -> int:
    """Terminate the server session behind ``obj`` (an ``Elector``, a ``Member`` or
    a ``LockHolder``, which must be running); returns the pid that was ended."""
    pid = _backend_pid(obj)
    await _run(dsn, "testing_terminate", pid)
    return pid


def pause(seconds: float) -> None:
    """Stop this whole process for ``seconds`` (a long GC pause, a SIGSTOP): this
    thread, and the event loop on which ``pgcoord.sync`` twins run if they do.
    Nothing of it runs meanwhile, while the server and other processes go on. Call
    it from the event loop's thread to pause your async electors too."""
    from .sync import _portal

    portal = _portal._portal
    if portal is not None and not portal.on_loop():
        portal.soon(time.sleep, seconds)
    time.sleep(seconds)


def pause_past_ttl(obj: Any, *, factor: float = 1.2) -> float:
    """``pause`` long enough for the server to end the silent session of an ``Elector``
    or ``Member`` (or a twin) and for its lease to expire: ``factor`` x the longer of
    its ttl and, for an elector on a member, 0.9 x the member's ttl (the member's
    ``idle_session_timeout``). Returns the seconds paused."""
    from .elector.elector import Elector
    from .member import Member

    inner = _unwrap(obj)
    if not isinstance(inner, Elector | Member):
        raise TypeError(f"pause_past_ttl takes an Elector or a Member, not {type(obj).__name__}")
    ttl = float(inner.ttl)
    member = inner._member if isinstance(inner, Elector) else inner
    if member is not None:
        ttl = max(ttl, member.ttl * 0.9)
    seconds = ttl * factor
    pause(seconds)
    return seconds


async def run_slot(sched: Any, job: str, at: Any) -> Any:
    """Run slot ``at`` (an aware datetime, due or past, an instant of the schedule) of
    ``job`` now on ``sched`` (a ``Scheduler`` or its sync twin): claimed, run and
    recorded as the scheduler does, once (``backfill`` of that one instant).
    ``ValueError`` when ``at`` is not one of the schedule's instants or already has a
    row (it ran, or was recorded missed or skipped: look at ``pgcoord.job_slots``)."""
    from .sync._twins import _Twin

    if isinstance(sched, _Twin):
        ran = await asyncio.to_thread(sched.backfill, job, at, at)
    else:
        ran = await sched.backfill(job, at, at)
    if not ran:
        raise ValueError(f"slot {at.isoformat()} of {job!r} did not run: it is not an instant of "
                         "the schedule, or it already has a row in pgcoord.job_slots")
    return ran[0]


async def advance(sched: Any, to: Any) -> list[Any]:
    """Move the async ``Scheduler`` ``sched`` forward to the aware datetime ``to`` (not
    before where it is) and tick once; returns the slots that ran, after their runs
    ended. The database and other replicas keep real time: only this scheduler's idea
    of now moves (claims and records still use the database's clock)."""
    import datetime as dt

    from .scheduler import Scheduler

    if not isinstance(sched, Scheduler):
        raise TypeError(f"advance takes a pgcoord.Scheduler, not {type(sched).__name__}")
    if not isinstance(to, dt.datetime) or to.utcoffset() is None:
        raise ValueError(f"advance needs an aware datetime, got {to!r}")
    now = await sched._database_now()
    shift = (to - now).total_seconds()
    if shift < sched._time_shift:
        raise ValueError(f"the scheduler is already at {now + dt.timedelta(seconds=sched._time_shift)}: "
                         "time does not go back")
    if sched._run_task is None and sched.jobs:
        # Not running: write the code's schedules as run() would first.
        await sched._declare()
        sched._epoch = None
    before = set(sched._runs.running)
    sched._time_shift = shift
    await sched.tick()
    jittered = sched._jitters.pending()  # decided beside the tick, each after its wait
    if jittered:
        await asyncio.wait(jittered)
    started = {key: run for key, run in sched._runs.running.items() if key not in before}
    tasks = [run.task for run in started.values() if run.task is not None]
    if tasks:
        await asyncio.wait(tasks)
    return [run.slot for run in started.values()]


async def wait_until(predicate: Callable[[], Any | Awaitable[Any]], within: float = 5.0,
                     interval: float = 0.02) -> Any:
    """Poll ``predicate`` (a function, or an async one) until it returns something
    true, and return that; ``AssertionError`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {within} s: {predicate!r}")
        await asyncio.sleep(interval)
