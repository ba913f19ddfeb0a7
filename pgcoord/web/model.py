"""What each page shows, worked out from one sample: pure functions, no I/O. The
JSON twins under /api/ return exactly these dicts."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections import defaultdict
from typing import Any

from ..scheduler.schedules import ScheduleInfo, infos
from .sample import Sample

Row = dict[str, Any]

#: An election whose last holder went away less than this long ago, and that nobody
#: holds again, raises the "no leader" alert (older ones are leases nobody uses).
NO_LEADER_WINDOW = dt.timedelta(minutes=15)
#: Terms that ended this badly this recently count as locks lost.
LOST_WINDOW = dt.timedelta(minutes=15)
SCHEDULES_PER_PAGE = 100
LOCKS_PER_PAGE = 200
SLOTS_PER_PAGE = 50
#: The alerts of one kind listed on the overview (the count says how many in all).
ALERTS_SHOWN = 20

_PART = re.compile(r"^(?P<name>.+)/(?P<index>\d+)$")


class PageOutOfRange(LookupError):
    """A page number past the last page."""


def when(value: str | dt.datetime | None) -> dt.datetime | None:
    if value is None or isinstance(value, dt.datetime):
        return value
    return dt.datetime.fromisoformat(value)


def _ago(sample: Sample, value: str | None) -> dt.timedelta | None:
    moment = when(value)
    return None if moment is None else sample.now - moment


def is_part(name: str) -> bool:
    """A lease named ``<partitions>/<index>``: one part of a ``Partitions``."""
    return _PART.match(name) is not None


def internal(row: Row) -> bool:
    """One of pgcoord's own session locks (an elector's doorbell, a candidacy, a
    member's liveness lock and the watchers that wait on it): held and awaited by
    design, so never an alert, and listed apart from the application's locks."""
    return (row.get("name") or "").startswith("pgcoord.")


def failing(row: Row) -> bool:
    return not row["paused"] and (row["failures_in_row"] > 0
                                  or row["last_state"] in ("failed", "abandoned"))


def pages(total: int, per_page: int) -> int:
    return max(1, math.ceil(total / per_page))


def check_page(page: int, total: int, per_page: int) -> int:
    last = pages(total, per_page)
    if page > last:
        raise PageOutOfRange(f"page {page} is past the end: there {'is' if last == 1 else 'are'} "
                             f"{last} page{'' if last == 1 else 's'}")
    return (page - 1) * per_page


# -- overview -------------------------------------------------------------------------------

def health(sample: Sample) -> Row:
    return {"ok": sample.error is None, "error": sample.error, "database": sample.database,
            "server_version": sample.server_version, "sampled_at": sample.now.isoformat(),
            "read_ms": round(sample.read_seconds * 1000, 1), "history": sample.terms is not None}


def elections_without_leader(sample: Sample) -> list[Row]:
    out = []
    for lease in sample.leases:
        if lease["held"] or is_part(lease["name"]):
            continue
        gone = _ago(sample, lease["expires_at"])
        if gone is not None and gone < NO_LEADER_WINDOW:
            out.append({"name": lease["name"], "since": lease["expires_at"],
                        "seconds": gone.total_seconds(), "last_holder_fence": lease["fence"]})
    return out


def locks_lost(sample: Sample) -> list[Row]:
    """Holdings whose holder's session is gone (orphans), and terms that ended by
    expiry or a lost session lately."""
    out = [{"kind": r["kind"], "name": r["name"] or f"#{r['key']}", "holder": r["holder"],
            "how": "orphaned: its holder's session is gone", "since": r["since"]}
           for r in sample.holders if r.get("session_alive") is False]
    for t in sample.terms or ():
        ended = _ago(sample, t["ended_at"])
        if t["ended_how"] in ("expired", "session_ended") and ended is not None and ended < LOST_WINDOW:
            out.append({"kind": "lease", "name": t["name"], "holder": t["holder"],
                        "how": t["ended_how"].replace("_", " "), "since": t["ended_at"]})
    return out


def _held_by(r: Row) -> str:
    pids = r.get("blocked_by")
    return f" held by pid {', '.join(map(str, pids))}" if pids else ""


def overview(sample: Sample) -> Row:
    held = [r for r in sample.holders if r["granted"] and not internal(r)]
    waiting = [r for r in sample.holders if not r["granted"] and not internal(r)]
    failing_rows = [s for s in sample.schedules if failing(s)]
    no_leader = elections_without_leader(sample)
    lost = locks_lost(sample)
    waits = sorted(waiting, key=lambda r: -(r.get("age_seconds") or 0))
    alerts: list[Row] = []
    alerts += [{"kind": "no_leader", "name": e["name"], "text": f"no leader for {e['name']}",
                "seconds": e["seconds"]} for e in no_leader[:ALERTS_SHOWN]]
    alerts += [{"kind": "failing_schedule", "name": s["name"],
                "text": f"schedule {s['name']} is failing: {s['failures_in_row']} failure(s) in a row, "
                        f"last {s['last_state']}", "seconds": None} for s in failing_rows[:ALERTS_SHOWN]]
    alerts += [{"kind": "lock_wait", "name": r["name"] or f"#{r['key']}",
                "text": f"{r['holder']} (pid {r['pid']}) waits for {r['kind']} "
                        f"{_label(r)}" + _held_by(r),
                "seconds": r.get("age_seconds")} for r in waits[:ALERTS_SHOWN]]
    alerts += [{"kind": "lock_lost", "name": x["name"], "seconds": None,
                "text": f"{x['kind']} {x['name']} of {x['holder']}: {x['how']}"}
               for x in lost[:ALERTS_SHOWN]]
    kinds: dict[str, int] = defaultdict(int)
    for r in held:
        kinds[r["kind"]] += 1
    return {
        "health": health(sample),
        "counts": {
            "elections": sum(1 for lease in sample.leases if not is_part(lease["name"])),
            "leaders": sum(1 for lease in sample.leases if lease["held"] and not is_part(lease["name"])),
            "no_leader": len(no_leader),
            "members": len(sample.members),
            "groups": len({m["group"] for m in sample.members}),
            "held": len(held), "held_by_kind": dict(sorted(kinds.items())),
            "waiting": len(waiting),
            "schedules": len(sample.schedules),
            "paused": sum(1 for s in sample.schedules if s["paused"]),
            "failing": len(failing_rows),
            "running": kinds.get("job", 0),
            "locks_lost": len(lost),
            "internal": sum(1 for r in sample.holders if internal(r)),
        },
        "alerts": alerts,
    }


# -- elections ------------------------------------------------------------------------------

def elections(sample: Sample) -> Row:
    by_name = {r["name"]: r for r in sample.holders if r["kind"] == "lease"}
    terms: dict[str, list[Row]] = defaultdict(list)
    for t in sample.terms or ():
        terms[t["name"]].append(t)
    rows = []
    for lease in sample.leases:
        if is_part(lease["name"]):
            continue
        h = by_name.get(lease["name"]) if lease["held"] else None
        rows.append({
            "name": lease["name"], "held": lease["held"],
            "holder": lease["holder"] if lease["held"] else None,
            "member": h and h.get("member"), "pid": lease["holder_pid"] if lease["held"] else None,
            "application_name": h and h.get("application_name"),
            "client_addr": h and h.get("client_addr"),
            "session_alive": h.get("session_alive") if h else None,
            "fence": lease["fence"], "acquired_at": lease["acquired_at"],
            "expires_at": lease["expires_at"],
            "term_seconds": lease["term_seconds"] if lease["held"] else None,
            "left_seconds": lease["left_seconds"] if lease["held"] else None,
            "terms": terms.get(lease["name"], []),
        })
    return {"elections": rows, "history": sample.terms is not None}


# -- members --------------------------------------------------------------------------------

def members(sample: Sample) -> Row:
    parts: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in sample.holders:
        m = _PART.match(r["name"] or "") if r["kind"] == "lease" and r["granted"] else None
        if m and r.get("pid") is not None:
            parts[r["pid"]][m["name"]].append(int(m["index"]))
    holds: dict[int, int] = defaultdict(int)
    for r in sample.holders:
        if r["granted"] and r.get("pid") is not None:
            holds[r["pid"]] += 1
    groups: dict[str, list[Row]] = defaultdict(list)
    for member in sample.members:
        held = parts.get(member["pid"], {})
        groups[member["group"]].append({
            **member, "partitions": {k: sorted(v) for k, v in sorted(held.items())},
            "holds": holds.get(member["pid"], 0),
        })
    return {"groups": [{"group": g, "members": ms} for g, ms in sorted(groups.items())]}


# -- locks ----------------------------------------------------------------------------------

def _label(r: Row) -> str:
    return r["name"] if r["name"] is not None else f"#{r['key']}"


def locks(sample: Sample, page: int = 1) -> Row:
    """Page ``page`` of the application's holders and waiters (waiters first), the
    whole wait-for graph, and pgcoord's own locks."""
    every = [r for r in sample.holders if r["kind"] in ("advisory", "semaphore")]
    rows = [r for r in every if not internal(r)]
    holding: dict[int, list[Row]] = defaultdict(list)
    for r in sample.holders:
        if r["granted"] and r.get("pid") is not None:
            holding[r["pid"]].append(r)
    edges = []
    for w in rows:
        if w["granted"]:
            continue
        for pid in w.get("blocked_by") or ():
            held = holding.get(pid, [])
            same = [h for h in held if h["kind"] == w["kind"] and h["key"] == w["key"]]
            edges.append({
                "waiter_pid": w["pid"], "waiter": w["holder"], "lock": _label(w), "kind": w["kind"],
                "waiting_seconds": w.get("age_seconds"), "blocker_pid": pid,
                "blocker": (same or held or [{"holder": f"pid {pid}"}])[0]["holder"],
            })
    skip = check_page(page, len(rows), LOCKS_PER_PAGE)
    ordered = [r for r in rows if not r["granted"]] + [r for r in rows if r["granted"]]
    return {"locks": ordered[skip: skip + LOCKS_PER_PAGE], "waits_for": edges,
            "internal": [r for r in every if internal(r)], "page": page,
            "pages": pages(len(rows), LOCKS_PER_PAGE), "total": len(rows)}


# -- schedules ------------------------------------------------------------------------------

def schedule_json(info: ScheduleInfo) -> Row:
    """One schedule as ``pgcoord jobs --json`` prints it."""
    return {k: v.isoformat() if isinstance(v, dt.datetime) else v for k, v in vars(info).items()}


def schedule_names(sample: Sample, page: int) -> list[str]:
    """The names on page ``page`` of /schedules (PageOutOfRange past the end)."""
    skip = check_page(page, len(sample.schedules), SCHEDULES_PER_PAGE)
    return [s["name"] for s in sample.schedules[skip: skip + SCHEDULES_PER_PAGE]]


def schedules(sample: Sample, page: int, now: dt.datetime, rows: Any) -> Row:
    """One page of /schedules from its full rows (``web_schedule_rows``)."""
    total = len(sample.schedules)
    shown = [{**schedule_json(i), "failing": bool(i.error) or failing(vars(i))} for i in infos(now, rows)]
    return {"schedules": shown, "page": page, "pages": pages(total, SCHEDULES_PER_PAGE), "total": total}
