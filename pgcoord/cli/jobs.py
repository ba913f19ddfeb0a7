"""``pgcoord jobs``: the schedules, their history, and pause/resume/trigger.

    pgcoord jobs [--json]                        every schedule: last run, next run, failures
    pgcoord jobs history NAME [--limit N]        the latest slots of NAME
    pgcoord jobs pause|resume|trigger NAME       through pgcoord.schedule_pause() etc.

A NAME that names no schedule exits 6 (2 is a bad command line).

``trigger`` owes one run now: a replica that has the schedule's handler runs it
(as a manual slot) at its next tick, or at once when it listens.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from .._core.checks import INT4_MAX
from .._core.errmap import schema_missing_raised
from .._core.queries import query
from .._drivers.dsn import fetch_rows
from ..scheduler.schedules import RESUME_CATCH_UP, ScheduleInfo, infos
from .errors import CONNECT_TIMEOUT, EXIT_NOT_FOUND, EXIT_USAGE, CliError, check_number, libpq_dsn

ACTIONS = ("history", "pause", "resume", "trigger")


def add_parser(sub: Any, parents: list[argparse.ArgumentParser], dsn_default: str | None,
               epilog: str) -> None:
    jobs = sub.add_parser("jobs", parents=parents, help="list schedules; history, pause, resume, "
                          "trigger one", description=__doc__, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs.add_argument("action", nargs="?", choices=ACTIONS, help="what to do with NAME")
    jobs.add_argument("name", nargs="?", metavar="NAME", help="a schedule's name")
    jobs.add_argument("--dsn", default=dsn_default,
                      help="database URL or key=value string (default $PGCOORD_DSN, then $DATABASE_URL)")
    jobs.add_argument("--json", action="store_true", help="print JSON")
    jobs.add_argument("--limit", type=int, default=20, help="history: how many slots (default 20)")
    jobs.add_argument("--catch-up", default="none", choices=RESUME_CATCH_UP,
                      help="resume: 'latest' runs once now if a slot was skipped while paused")
    jobs.set_defaults(func=run_jobs)


def _fetch_one(dsn: str, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """One statement, autocommit, through the driver the one DSN rule picks for an
    operator's command (psycopg first; see ``_drivers/dsn.py``); its first row."""
    with schema_missing_raised():
        _, rows = fetch_rows(libpq_dsn(dsn), sql, params, application_name="pgcoord jobs",
                             connect_timeout=CONNECT_TIMEOUT)
    return rows[0] if rows else None


def _when(value: dt.datetime | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _as_json(value: Any) -> Any:
    return value.isoformat() if isinstance(value, dt.datetime) else value


def run_jobs(args: argparse.Namespace) -> int:
    from .main import _require_dsn

    dsn = _require_dsn(args)
    if args.action is None:
        if args.name is not None:
            raise CliError(EXIT_USAGE, f"unknown action {args.name!r}: use one of {', '.join(ACTIONS)}")
        return _list(dsn, as_json=args.json)
    if not args.name:
        raise CliError(EXIT_USAGE, f"pgcoord jobs {args.action} needs a schedule NAME")
    if args.action == "history":
        if args.limit < 1:
            raise CliError(EXIT_USAGE, "--limit takes a number greater than 0")
        check_number(args.limit, "--limit", minimum=1, maximum=INT4_MAX, integer=True)
        return _history(dsn, args.name, args.limit, as_json=args.json)
    if args.action == "trigger":
        row = _fetch_one(dsn, query("schedule_trigger"), (args.name,))
        if row is None or row[0] is None:
            raise CliError(EXIT_NOT_FOUND, f"no schedule named {args.name!r}")
        _say(args, {"name": args.name, "triggered": _as_json(row[0])},
             f"{args.name}: a run is owed at {_when(row[0])}; a replica with its handler runs it")
        return 0
    if args.action == "pause":
        row = _fetch_one(dsn, query("schedule_pause"), (args.name,))
    else:
        row = _fetch_one(dsn, query("schedule_resume"), (args.name, args.catch_up))
    if row is None or not row[0]:
        raise CliError(EXIT_NOT_FOUND, f"no schedule named {args.name!r}")
    done = "paused" if args.action == "pause" else "resumed"
    _say(args, {"name": args.name, "state": done}, f"{args.name}: {done}")
    return 0


def _say(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data) if args.json else text)


def _list(dsn: str, *, as_json: bool) -> int:
    row = _fetch_one(dsn, query("schedule_list"), (None,))
    assert row is not None
    found = infos(row[0], row[1])
    if as_json:
        print(json.dumps([{k: _as_json(v) for k, v in vars(i).items()} for i in found], indent=2))
        return 0
    print(_table(found))
    return 0


def _table(found: list[ScheduleInfo]) -> str:
    head = ("NAME", "EXPR", "TZ", "PAUSED", "LAST RUN", "STATE", "NEXT RUN", "FAILS")
    rows = [head] + [(
        i.name, i.expr, i.tz, "yes" if i.paused else "no", _when(i.last_run_at),
        (i.last_state or "-") + (f" ({i.last_reason})" if i.last_reason else ""),
        _next(i), str(i.failures_in_row),
    ) for i in found]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if not found:
        lines.append("(no schedules)")
    lines += [f"{i.name}: invalid, no replica runs it: {i.error}; fix it with update()"
              for i in found if i.error]
    return "\n".join(lines)


def _next(info: ScheduleInfo) -> str:
    if info.error:
        return "invalid"
    return "paused" if info.paused else _when(info.next_run_at)


def _history(dsn: str, name: str, limit: int, *, as_json: bool) -> int:
    exists = _fetch_one(dsn, query("schedule_list"), (name,))
    slots_row = _fetch_one(dsn, query("schedule_history"), (name, limit))
    assert exists is not None and slots_row is not None
    text = slots_row[0]
    slots = json.loads(text) if isinstance(text, str) else text
    if not slots and json.loads(exists[1]) == []:
        raise CliError(EXIT_NOT_FOUND, f"no schedule named {name!r}, and no slots recorded under it")
    if as_json:
        print(json.dumps(slots, indent=2))
        return 0
    head = ("SLOT", "MANUAL", "STATE", "REASON", "ATTEMPT", "RUNNER", "FINISHED", "ERROR")
    rows = [head] + [(
        _when(s["slot_at"]), "yes" if s["manual"] else "", s["state"], s["reason"] or "",
        str(s["attempt"]), s["runner"] or "", _when(s["finished_at"]), (s["error"] or "")[:60],
    ) for s in slots]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    print("\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
                    for r in rows))
    return 0
