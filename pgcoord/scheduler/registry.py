"""What a replica can run: the schedules its code declares (``@sched.cron``), the
handlers it registers for schedules added at run time (``@sched.job``), and the
rows loaded from ``pgcoord.schedules`` as the ``Job`` objects it runs. No I/O.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .._core.checks import seconds, text
from ..errors import UnsupportedConnection
from . import schedules as _schedules
from .cron import Handler, Job, check_expr, check_zone
from .runner import Slot, as_utc

log = logging.getLogger("pgcoord.scheduler")

JobFn = Callable[[Slot], Coroutine[Any, Any, Any]]


def _pauses(text: str | None) -> tuple[tuple[dt.datetime, dt.datetime | None], ...]:
    """``schedule_load``'s pauses of a schedule (JSON pairs of UTC instants)."""
    if text is None:
        return ()
    return tuple((_instant(start), None if end is None else _instant(end))
                 for start, end in json.loads(text))


def _instant(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(dt.UTC)


class Registry:
    """The code's schedules and the handlers, by name, checked as they are registered."""

    def __init__(self, capacity: int | None) -> None:
        self._capacity = capacity  # connections the pool lends at once (None: no bound known)
        #: The jobs declared in code with ``@cron``, by name.
        self.jobs: dict[str, Job] = {}
        self.handlers: dict[str, Handler] = {}
        self._bad_rows: set[tuple[str, int]] = set()  # rows already logged as unusable

    def cron(
        self, job: str, expr: str, *, tz: str, on_crash: str, max_attempts: int, catch_up: str,
        deadline: float | None, transactional: bool, allow_overlap: bool, jitter: float,
        claim_ttl: float, keep: float, timeout: float | None,
    ) -> Callable[[JobFn], JobFn]:
        """``Scheduler.cron``."""
        text(job, "job name")
        if job in self.jobs:
            raise ValueError(f"job {job!r} is already registered")
        zone = check_zone(tz)
        check_expr(expr, zone)
        opts = _schedules.check_options(
            on_crash=on_crash, max_attempts=max_attempts, catch_up=catch_up, deadline=deadline,
            allow_overlap=allow_overlap, timeout=timeout)
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

    def job(self, handler: str, *, transactional: bool, jitter: float, claim_ttl: float,
            keep: float) -> Callable[[JobFn], JobFn]:
        """``Scheduler.job``."""
        text(handler, "handler name")
        if handler in self.handlers:
            raise ValueError(f"handler {handler!r} is already registered")
        spec = self._handler(handler, None, transactional, jitter, claim_ttl, keep)

        def register(fn: JobFn) -> JobFn:
            if not asyncio.iscoroutinefunction(fn):
                raise TypeError(f"handler {handler!r} must be an async function")
            spec.fn = fn
            self.handlers[handler] = spec
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

    def declared(self) -> str:
        """The code's schedules, as ``schedule_declare`` takes them (JSON)."""
        return json.dumps([{"name": s.name, "expr": s.expr, "tz": s.tz.key, "on_crash": s.on_crash,
                            "catch_up": s.catch_up, "deadline": s.deadline,
                            "allow_overlap": s.allow_overlap, "timeout": s.timeout,
                            "max_attempts": s.max_attempts}
                           for s in self.jobs.values()])

    def spec_from_row(self, values: tuple[Any, ...], loaded: dict[str, Job]) -> Job | None:
        """The schedule of a ``schedule_load`` row as this replica runs it: the one in
        ``loaded`` if its version did not change, else a new one that keeps what was
        decided of it; None when this replica has no function for it, or cannot read it."""
        (name, handler_name, expr, tz, args, paused, on_crash, catch_up, deadline, allow_overlap,
         timeout, max_attempts, in_code, since, paused_at, resumed_at, version, last,
         pauses) = values
        version = int(version)
        since = as_utc(since)
        old = loaded.get(name)
        # The same version of the same schedule: a schedule removed and added again
        # starts at version 1 again, but counts from a new `since`.
        if old is not None and old.version == version and old.registered_at == since:
            return old
        handler: Handler | Job | None = self.jobs.get(name) if in_code else self.handlers.get(handler_name)
        if handler is None:
            return None
        try:
            zone = check_zone(tz)
            check_expr(expr, zone)
            # NaN or infinity written through SQL (CHECK (timeout > 0) holds for NaN)
            # must not reach asyncio's timers.
            for value, what in ((timeout, "timeout"), (deadline, "deadline")):
                if value is not None:
                    seconds(float(value), what)
        except ValueError as exc:  # written by hand in SQL, perhaps: run nothing of it
            if (name, version) not in self._bad_rows:
                self._bad_rows.add((name, version))
                log.error("schedule %r (version %d) cannot run: %s", name, version, exc)
            return None
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
            pauses=_pauses(pauses),
        )
        decided = [since] + ([] if last is None else [as_utc(last)])
        if old is not None and old.after is not None:
            decided.append(old.after)
        spec.after = max(decided)
        spec.next_due = spec.next_after(spec.after)
        return spec
