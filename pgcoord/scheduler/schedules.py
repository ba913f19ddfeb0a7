"""Schedules as data (docs/schedules.md): the rows of ``pgcoord.schedules`` and the calls
that change them — add, update, pause, resume, remove — checked here, at the
call, so that a replica never meets a schedule it cannot read.

Slots and changes: a slot is due under the definition in force when it comes
due. A change of expression or zone counts slots afresh from the change; the old
expression's slots due before it that no replica had recorded yet (at most
CHANGED_SLOTS_MAX, the latest) are decided by the schedule's catch_up, as a
replica would have: those it would run are owed and run once, late; the others
are recorded ``missed`` (reason ``changed``). A paused schedule's slots are recorded
``skipped`` (reason ``paused``) as they come due, so every slot still has a row;
``resume(catch_up="latest")`` then owes one run now if the expression fired
during the pause (the replica that takes the owed run checks the expression).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo

from .._core.checks import count, no_nul, seconds, text
from .._core.queries import query
from .._drivers import run_statement
from .cron import CATCH_UP, ON_CRASH, check_expr, check_zone, next_slot, previous_slots

__all__ = ["SCHEDULES_CHANNEL", "ScheduleInfo"]

UTC = dt.UTC
#: The NOTIFY channel on which every change of pgcoord.schedules is announced.
SCHEDULES_CHANNEL = "pgcoord_schedules"
RESUME_CATCH_UP = ("none", "latest")
_OPTIONS = ("on_crash", "max_attempts", "catch_up", "deadline", "allow_overlap", "timeout")
_UPDATABLE = ("handler", "expr", "tz", "args", *_OPTIONS)
_UPDATE_TRIES = 5
#: A change of expression gives a row (or an owed run) to at most this many of the old
#: expression's unrecorded slots, the latest; older ones (a per-second schedule no
#: replica ran for more than a day) get none.
CHANGED_SLOTS_MAX = 100_000


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule, as ``Scheduler.schedules()`` and ``pgcoord jobs`` show it."""

    name: str
    handler: str
    expr: str
    tz: str
    args: Any
    paused: bool
    on_crash: str
    catch_up: str
    deadline: float | None
    allow_overlap: bool
    timeout: float | None
    max_attempts: int
    #: Declared with ``@sched.cron`` (the code owns it) rather than added at run time.
    in_code: bool
    created_at: dt.datetime
    updated_at: dt.datetime
    version: int
    #: The latest slot with a row (manual runs included), its state and reason.
    last_run_at: dt.datetime | None
    last_state: str | None
    last_reason: str | None
    #: The next scheduled instant (UTC) after the database clock; None if it never fires.
    next_run_at: dt.datetime | None
    #: Failed or abandoned slots since the latest success.
    failures_in_row: int
    #: Why no replica can run it (an expression or zone written through SQL that the
    #: library refuses), else None. ``update()`` with a good ``expr``/``tz`` repairs it.
    error: str | None = None


def check_options(*, on_crash: Any = "skip", max_attempts: Any = 3, catch_up: Any = "latest",
                  deadline: Any = None, allow_overlap: Any = False, timeout: Any = None,
                  ) -> dict[str, Any]:
    """The per-schedule options, checked; ValueError for a bad one."""
    if on_crash not in ON_CRASH:
        raise ValueError(f"on_crash must be one of {ON_CRASH}, not {on_crash!r}")
    if catch_up not in CATCH_UP:
        raise ValueError(f"catch_up must be one of {CATCH_UP}, not {catch_up!r}")
    count(max_attempts, "max_attempts")  # an integer column
    if not isinstance(allow_overlap, bool):
        raise ValueError(f"allow_overlap must be a bool, got {allow_overlap!r}")
    if timeout is not None and seconds(timeout, "timeout") == 0:
        raise ValueError("timeout must be a number of seconds > 0, or None")
    return {"on_crash": on_crash, "max_attempts": max_attempts, "catch_up": catch_up,
            "deadline": seconds(deadline, "deadline", allow_none=True),
            "allow_overlap": allow_overlap,
            "timeout": seconds(timeout, "timeout", allow_none=True)}


def _check_name(name: Any, what: str = "schedule name") -> str:
    return text(name, what)


def _json_args(args: Any) -> str:
    """``args`` as the JSON text jsonb stores. TypeError for a value that is not
    JSON; ValueError for one jsonb cannot hold (NaN, infinity, a NUL character) or
    that is too big to write (an int of more digits than Python converts)."""
    value = {} if args is None else args
    try:
        encoded = json.dumps(value, allow_nan=False)
    except TypeError as exc:
        raise TypeError(f"schedule args must be JSON (dict, list, str, number, bool, None): {exc}") from exc
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"schedule args cannot be stored as jsonb: {exc}") from exc
    no_nul(value, "schedule args")
    return encoded


async def add(source: Any, name: str, expr: str, *, handler: str, tz: str = "UTC", args: Any = None,
              paused: bool = False, **options: Any) -> ScheduleInfo:
    _check_name(name)
    _check_name(handler, "handler")
    check_expr(expr, check_zone(tz))
    if not isinstance(paused, bool):
        raise ValueError(f"paused must be a bool, got {paused!r}")
    opts = check_options(**options)
    row = await run_statement(source, query("schedule_add"), (
        name, handler, expr, tz, _json_args(args), json.dumps({**opts, "paused": paused})))
    if row is None or row[0] is None:
        raise ValueError(f"a schedule named {name!r} exists already: change it with update()")
    return await get(source, name)


async def update(source: Any, name: str, **changes: Any) -> ScheduleInfo:
    _check_name(name)
    unknown = set(changes) - set(_UPDATABLE)
    if unknown:
        raise TypeError(f"update() got unknown option(s) {sorted(unknown)}; "
                        f"it takes {', '.join(_UPDATABLE)}")
    if "handler" in changes:
        _check_name(changes["handler"], "handler")
    options = {k: changes[k] for k in _OPTIONS if k in changes}
    # Check the given options against the defaults; the SQL keeps the others as they are.
    check_options(**options)
    payload: dict[str, Any] = {k: v for k, v in changes.items() if k != "args"}
    if "args" in changes:
        payload["args"] = json.loads(_json_args(changes["args"]))
    await _change(source, name, changes, payload, in_code_ok=False)
    return await get(source, name)


async def redeclare(source: Any, specs: Iterable[Any]) -> None:
    """Before a replica's start declares the code's schedules (``schedule_declare``):
    each whose expression or zone in code differs from its row is changed as
    ``update()`` changes one, so that the new expression counts from the change and
    the old one's slots due before it that no replica recorded are decided by the
    schedule's catch_up (run once, late, or recorded missed, reason 'changed')."""
    for spec in specs:
        row = await run_statement(source, query("schedule_get"), (spec.name,))
        if row is None or (row[0], row[1]) == (spec.expr, spec.tz.key):
            continue
        changes = {"expr": spec.expr, "tz": spec.tz.key}
        try:
            await _change(source, spec.name, changes, changes, in_code_ok=True)
        except ValueError:
            # The row's own expression cannot be read (written by hand in SQL): its slots
            # cannot be worked out; schedule_declare still counts the new one from now.
            continue


async def _change(source: Any, name: str, changes: dict[str, Any], payload: dict[str, Any], *,
                  in_code_ok: bool) -> None:
    for _ in range(_UPDATE_TRIES):
        row = await run_statement(source, query("schedule_get"), (name,))
        if row is None:
            raise ValueError(f"no schedule named {name!r}")
        old_expr, old_tz, since, version, in_code, now, last = row
        if in_code and not in_code_ok:
            raise ValueError(f"schedule {name!r} is declared in code (@sched.cron): change it "
                             "there (pause() and resume() work on it)")
        new_tz = changes.get("tz", old_tz)
        check_expr(changes.get("expr", old_expr), check_zone(new_tz))
        missed: list[dt.datetime] = []
        horizon = now + dt.timedelta(seconds=1)
        if changes.get("expr", old_expr) != old_expr or new_tz != old_tz:
            # The old expression's slots up to the change that no replica recorded:
            # worked out to a horizon a second ahead; the change is refused (and
            # tried again) if it lands after the horizon.
            after = max(since, last) if last is not None else since
            # Walked back from the horizon: the latest ones are those catch_up
            # decides on, and a backlog beyond the bound costs no walk over it.
            old_zone = _readable(old_expr, old_tz)
            if old_zone is not None:  # an unreadable row (written through SQL) had no slots
                missed = previous_slots(old_expr, old_zone, horizon, CHANGED_SLOTS_MAX,
                                        after=after)[::-1]
        done = await run_statement(source, query("schedule_update"), (
            name, json.dumps(payload), version, horizon, missed))
        if done is not None and done[0] is not None:
            return
    raise ValueError(f"schedule {name!r} kept changing under update(); try again")


def _readable(expr: Any, tz: Any) -> ZoneInfo | None:
    """The zone of a stored row whose expression and zone the library can read; None
    for one written through SQL that it cannot."""
    try:
        zone = check_zone(tz)
        check_expr(expr, zone)
    except ValueError:
        return None
    return zone


def row_error(expr: Any, tz: Any, timeout: Any = None, deadline: Any = None) -> str | None:
    """Why a stored schedule cannot run (a bad expression, zone or duration written
    through SQL: a CHECK (timeout > 0) holds for NaN), or None."""
    try:
        check_expr(expr, check_zone(tz))
        for value, what in ((timeout, "timeout"), (deadline, "deadline")):
            if value is not None:
                seconds(float(value), what)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


async def pause(source: Any, name: str) -> None:
    row = await run_statement(source, query("schedule_pause"), (_check_name(name),))
    if row is None or not row[0]:
        raise ValueError(f"no schedule named {name!r}")


async def resume(source: Any, name: str, *, catch_up: str = "none") -> None:
    if catch_up not in RESUME_CATCH_UP:
        raise ValueError(f"resume catch_up must be one of {RESUME_CATCH_UP}, not {catch_up!r} "
                         "(the slots of the pause are recorded skipped; 'latest' runs one now)")
    row = await run_statement(source, query("schedule_resume"), (_check_name(name), catch_up))
    if row is None or not row[0]:
        raise ValueError(f"no schedule named {name!r}")


async def remove(source: Any, name: str) -> None:
    row = await run_statement(source, query("schedule_get"), (_check_name(name),))
    if row is None:
        raise ValueError(f"no schedule named {name!r}")
    if row[4]:
        raise ValueError(f"schedule {name!r} is declared in code (@sched.cron): remove it there")
    await run_statement(source, query("schedule_remove"), (name,))


async def list_all(source: Any, name: str | None = None) -> list[ScheduleInfo]:
    row = await run_statement(source, query("schedule_list"), (name,))
    assert row is not None
    return infos(row[0], row[1])


async def get(source: Any, name: str) -> ScheduleInfo:
    found = await list_all(source, name)
    if not found:
        raise ValueError(f"no schedule named {name!r}")
    return found[0]


def _when(value: str | None) -> dt.datetime | None:
    return None if value is None else dt.datetime.fromisoformat(value).astimezone(UTC)


def infos(now: dt.datetime, text: str | list[Any]) -> list[ScheduleInfo]:
    """ScheduleInfo for each row of the ``schedule_list`` query (a JSON array)."""
    rows = json.loads(text) if isinstance(text, str) else text
    now = now.astimezone(UTC)
    found = []
    for r in rows:
        # One row written badly through SQL is listed, flagged, and hides no other.
        error = row_error(r["expr"], r["tz"], r.get("timeout"), r.get("deadline"))
        next_at: dt.datetime | None = None
        if error is None:
            since = _when(r["since"])
            assert since is not None
            try:
                next_at = next_slot(r["expr"], check_zone(r["tz"]), max(now, since))
            except ValueError:  # it never fires again
                next_at = None
        found.append(ScheduleInfo(
            name=r["name"], handler=r["handler"], expr=r["expr"], tz=r["tz"], args=r["args"],
            paused=r["paused"], on_crash=r["on_crash"], catch_up=r["catch_up"],
            deadline=r["deadline"], allow_overlap=r["allow_overlap"], timeout=r["timeout"],
            max_attempts=r["max_attempts"], in_code=r["in_code"],
            created_at=_when(r["created_at"]) or now, updated_at=_when(r["updated_at"]) or now,
            version=r["version"], last_run_at=_when(r["last_run_at"]),
            last_state=r["last_state"], last_reason=r["last_reason"], next_run_at=next_at,
            failures_in_row=r["failures_in_row"], error=error,
        ))
    return found
