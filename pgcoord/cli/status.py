"""``pgcoord status``: the operators' view of ``pgcoord.holders``."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from .._core.errmap import schema_missing_raised
from .._core.queries import query
from .._drivers.dsn import fetch_rows
from .errors import CONNECT_TIMEOUT, libpq_dsn

Row = dict[str, Any]


def fetch_holders(dsn: str) -> list[Row]:
    """Rows of ``pgcoord.holders``, through the driver the one DSN rule picks for an
    operator's command (psycopg first; see ``_drivers/dsn.py``)."""
    with schema_missing_raised():
        names, rows = fetch_rows(libpq_dsn(dsn), query("holders_list"),
                                 application_name="pgcoord status", connect_timeout=CONNECT_TIMEOUT)
    return [dict(zip(names, row, strict=True)) for row in rows]


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# (title, width); NAME takes whatever the terminal leaves.
COLUMNS = (("KIND", 9), ("NAME", 0), ("HOLDER", 18), ("STATE", 7), ("AGE", 6), ("LEFT", 6),
           ("FENCE", 5))


def format_table(rows: list[Row], width: int = 80) -> str:
    """A table of ``pgcoord.holders`` that fits ``width`` columns.

    Names are shown wherever one is known (``#key`` otherwise); a waiter gets a
    line naming the pids it waits on; LEFT is a lease's or job claim's time to
    expiry, FENCE its fence (a job's attempt).
    """
    fixed = sum(w for _, w in COLUMNS) + len(COLUMNS) - 1
    widths = [w or max(12, width - fixed) for _, w in COLUMNS]
    lines = [" ".join(title.ljust(w) for (title, _), w in zip(COLUMNS, widths, strict=True))]
    for r in rows:
        name = r["name"] if r["name"] is not None else f"#{r['key']}"
        holder = r["holder"] or "-"
        if r.get("pid") is not None:
            holder = f"{_clip(holder, widths[2] - len(str(r['pid'])) - 1)}/{r['pid']}"
        state = "held" if r["granted"] else "waiting"
        if r.get("session_alive") is False:
            state = "orphan"  # a lease or claim whose holder's session is gone
        cells = [
            r["kind"], name, holder, state, _age(r.get("age_seconds")),
            _age(r.get("expires_in_seconds")) if r.get("expires_at") else "-",
            "-" if r.get("fence") is None else str(r["fence"]),
        ]
        padded = (_clip(str(c), w).ljust(w) for c, w in zip(cells, widths, strict=True))
        lines.append(" ".join(padded).rstrip())
        if not r["granted"] and r.get("blocked_by"):
            lines.append(" " * (widths[0] + 1) + _clip(
                "waits for pid " + ", ".join(map(str, r["blocked_by"])), width - widths[0] - 1))
    if not rows:
        lines.append("(nobody holds or waits for anything)")
    return "\n".join(line.rstrip() for line in lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return value


def run_status(
    dsn: str, *, watch: float | None = None, as_json: bool = False,
    explain: Callable[[BaseException], str] = str,
) -> int:
    """Print the holders once, or every ``watch`` seconds until Ctrl-C.

    A first fetch that fails raises (the command exits with its code). Once
    watching, a failure (the server restarting, a network blip) is shown in
    place of the table, through ``explain``, and the next refresh tries again.
    """
    shown_once = False
    try:
        while True:
            try:
                rows: list[Row] | None = fetch_holders(dsn)
                error = None
            except Exception as exc:
                if not (watch and shown_once):
                    raise
                rows, error = None, exc
            shown_once = True
            if as_json:
                # Watching as JSON: one document per line, for a script to read as they come.
                if rows is None:
                    print(f"pgcoord: {explain(error) if error else ''}; trying again",
                          file=sys.stderr, flush=True)
                else:
                    doc = [{k: _jsonable(v) for k, v in r.items()} for r in rows]
                    print(json.dumps(doc) if watch else json.dumps(doc, indent=2), flush=True)
            else:
                if watch:
                    print("\x1b[2J\x1b[H", end="")
                    print(f"pgcoord status, every {watch:g}s, {time.strftime('%H:%M:%S')} (Ctrl-C to stop)")
                if rows is None:
                    print(f"{explain(error) if error else ''}; trying again", flush=True)
                else:
                    width = min(shutil.get_terminal_size((80, 24)).columns, 120)
                    print(format_table(rows, width), flush=bool(watch))
            if not watch:
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        if not watch:
            raise
        return 0  # Ctrl-C is how a watch ends
