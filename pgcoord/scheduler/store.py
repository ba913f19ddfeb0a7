"""The scheduler's statements on ``pgcoord.schedules`` and ``pgcoord.job_slots``.

Each method sends one named statement (``prune`` one per batch) and gives back
its row in Python terms: instants the loop works with in UTC, the rest as the
driver returned it. Nothing here keeps state beyond the source; what to send
and what to make of the answer is the loop's (``loop``) and the runner's.
(Heartbeats and records of a run's end are the runner's and the finisher's.)
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._core import errmap as _errmap
from .._core.aio import finish_despite_cancel
from .._core.queries import query
from .._drivers import driver_of, run_statement
from ..errors import UnsupportedConnection
from ..member.session import SessionLost
from .cron import Job
from .plan import Entry
from .runner import as_utc

if TYPE_CHECKING:
    from ..member import Member

#: A run owed by a trigger or a resume: (job, slot_at, slot_after, slot_until).
Owed = tuple[str, Any, Any, Any]


def refuse_shared_connection(source: Any) -> None:
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


def _overlap(spec: Job) -> str:
    """What a manual run (trigger, backfill) of ``spec`` does beside another run: go
    ahead if the job allows overlap, else wait for it to end."""
    return "run" if spec.allow_overlap else "wait"


class Store:
    """The statements of the loop, of manual runs and of retention, on ``source``."""

    def __init__(self, source: Any, member: Callable[[], Member | None] = lambda: None) -> None:
        self._source = source
        self._member = member

    async def _tick_row(self) -> tuple[Any, ...]:
        """``schedule_tick``'s row, on the scheduler's member's session while it has
        one: a tick a second is the scheduler's steadiest statement, and a pool's
        checkout costs a round trip of its own to give the connection back (asyncpg
        resets it): at 100 members, the most frequent round trip of all. The pool
        answers while the member joins again."""
        member = self._member()
        if member is not None and member.has_session:
            try:
                with _errmap.schema_missing_raised():
                    # Not cut halfway by a stop: a statement cancelled mid-flight can
                    # cost a shared session its life (psycopg), and with it every
                    # feature on the member. It is short: its lock waits are bounded.
                    row = await finish_despite_cancel(
                        member.session().fetchrow(query("schedule_tick_on_member")))
            except SessionLost:
                pass
            except Exception as exc:
                # Held up past its bound by a lock on the schedules' tables: the pool
                # waits for it instead, and the member's other statements do not.
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
                    raise
            else:
                assert row is not None
                return row
        row = await run_statement(self._source, query("schedule_tick"), ())
        assert row is not None
        return row

    async def clock(self) -> tuple[dt.datetime, int, list[Owed]]:
        """``schedule_tick``: the database clock, the schedules' change counter, and
        the runs owed."""
        row = await self._tick_row()
        owed = [] if row[2] is None else list(zip(row[2], row[3], row[4], row[5], strict=True))
        return as_utc(row[0]), int(row[1]), owed

    async def now(self) -> dt.datetime:
        """The database clock."""
        return as_utc((await self._tick_row())[0])

    async def load(self, handlers: list[str], jobs: list[str], names: list[str] | None = None,
                   ) -> tuple[int, list[tuple[Any, ...]]]:
        """``schedule_load``: the change counter, and a row for every schedule that
        names one of ``handlers`` or (declared in code) is one of ``jobs`` (and, given
        ``names``, is one of them)."""
        row = await run_statement(self._source, query("schedule_load"), (handlers, jobs, names))
        assert row is not None
        columns = row[2:]
        rows = [] if columns[0] is None else list(zip(*columns, strict=True))
        return int(row[0]), rows

    async def versions(self, handlers: list[str], jobs: list[str],
                       ) -> tuple[int, dict[str, tuple[int, dt.datetime]]]:
        """``schedule_versions``: the change counter, and the version and ``since`` of
        each schedule ``load`` would load, by name."""
        row = await run_statement(self._source, query("schedule_versions"), (handlers, jobs))
        assert row is not None
        if row[1] is None:
            return int(row[0]), {}
        return int(row[0]), {name: (int(v), as_utc(since))
                             for name, v, since in zip(row[1], row[2], row[3], strict=True)}

    async def declare(self, declared: str) -> dt.datetime:
        """``schedule_declare``: write the code's schedules (JSON); the database clock."""
        row = await run_statement(self._source, query("schedule_declare"), (declared,))
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    async def decide(self, part: list[Entry], runner: str) -> list[tuple[str, dt.datetime, str, Any]]:
        """``schedule_decide``: one batch of slots claimed for ``runner`` or recorded;
        for each slot the state it is in (``running``: claimed here, attempt given)."""
        row = await run_statement(self._source, query("schedule_decide"), (
            [e[0] for e in part], [e[1] for e in part], [e[2] for e in part],
            [e[3] for e in part], [e[4] for e in part], [e[5] for e in part],
            [e[6] for e in part], runner))
        if row is None or row[0] is None:
            return []
        return [(job, as_utc(at), state, attempt) for job, at, state, attempt in zip(*row, strict=True)]

    async def take_owed(self, specs: list[Job], ats: list[Any], runs: list[bool], runner: str,
                        ) -> list[tuple[str, dt.datetime, int, bool]]:
        """``schedule_take_owed``: claim the owed runs that ``runs`` says are owed (and
        drop the others); the (job, slot, attempt, manual) claimed. Of a job that must
        not overlap, only its earliest, and only while none of its runs is going."""
        row = await run_statement(self._source, query("schedule_take_owed"), (
            [s.name for s in specs], ats, runs, [int(s.claim_ttl * 1000) for s in specs],
            [s.allow_overlap for s in specs], runner))
        if row is None or row[0] is None:
            return []
        return [(job, as_utc(at), int(attempt), bool(manual))
                for job, at, attempt, manual in zip(*row, strict=True)]

    async def recover(self, specs: list[Job], runner: str) -> list[tuple[str, dt.datetime, int]]:
        """``schedule_recover``: record lost claims abandoned, or take those to retry;
        the (job, slot, attempt) taken for ``runner``."""
        row = await run_statement(self._source, query("schedule_recover"), (
            [s.name for s in specs], [int(s.claim_ttl * 1000) for s in specs],
            [s.on_crash == "retry" for s in specs], [s.max_attempts for s in specs], runner))
        if row is None or row[0] is None:
            return []
        return [(job, as_utc(at), int(attempt)) for job, at, attempt in zip(*row, strict=True)]

    async def prune(self, specs: list[Job], *, batch: int = 1000) -> int:
        """Delete the finished rows of ``specs`` older than their ``keep``, ``batch`` at a
        time; the count."""
        total = 0
        while True:
            row = await run_statement(self._source, query("schedule_prune"), (
                [s.name for s in specs], [int(s.keep * 1000) for s in specs], batch))
            deleted = int(row[0]) if row else 0
            total += deleted
            if deleted < batch:
                return total

    async def claim_now(self, spec: Job, runner: str) -> tuple[Any, int] | None:
        """``job_claim_now``: a manual slot of ``spec``, claimed; (its instant, attempt),
        or None while another run of a job that must not overlap is going."""
        row = await run_statement(self._source, query("job_claim_now"),
                                  (spec.name, runner, int(spec.claim_ttl * 1000), _overlap(spec)))
        if row is None or row[0] == "waiting":
            return None
        return row[2], int(row[1])

    async def claim(self, spec: Job, at: dt.datetime, runner: str) -> int | str | None:
        """``job_claim``: slot ``at`` of ``spec`` for ``runner``; its attempt, None if
        the slot has a row already, or ``"waiting"`` while another run of a job that
        must not overlap is going."""
        claim = await run_statement(self._source, query("job_claim"),
                                    (spec.name, at, runner, int(spec.claim_ttl * 1000), _overlap(spec)))
        if claim is not None and claim[0] == "waiting":
            return "waiting"
        if claim is None or claim[0] != "running":
            return None
        return int(claim[1])

    async def expire_claims_of(self, member_id: int) -> Any:
        """``job_expire_member_claims``: how many running claims of the member were expired."""
        row = await run_statement(self._source, query("job_expire_member_claims"), (member_id,))
        return None if row is None else row[0]
