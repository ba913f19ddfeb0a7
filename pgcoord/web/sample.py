"""One reading of the catalogue: what every page is drawn from."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from .._core.queries import query
from .reader import DatabaseError, Reader, explain

#: How many terms of each lease name the elections page shows.
TERMS_SHOWN = 5

#: Seconds after which the schedules are read again even if their mark did not move
#: (job_slots' row counts reach the statistics within about a second, not at once).
SCHEDULES_EVERY = 5.0

SCHEDULE_FIELDS = ("name", "paused", "version", "last_run_at", "last_state", "failures_in_row")

#: Fields that move on their own (clocks, renewals): a change in them alone is
#: not news for an open page.
_VOLATILE = frozenset({
    "now", "age_seconds", "expires_in_seconds", "term_seconds", "left_seconds", "renewed_at",
    "expires_at", "heartbeat_at", "held_seconds", "read_seconds",
})


@dataclass
class Sample:
    now: dt.datetime
    holders: list[dict[str, Any]] = field(default_factory=list)
    leases: list[dict[str, Any]] = field(default_factory=list)
    members: list[dict[str, Any]] = field(default_factory=list)
    #: Every schedule, lean (``web_schedules``): name, paused, version, last_run_at,
    #: last_state, failures_in_row. A page of /schedules reads its full rows itself.
    schedules: list[dict[str, Any]] = field(default_factory=list)
    #: The last terms of each lease name; None where the history is not installed.
    terms: list[dict[str, Any]] | None = None
    server_version: str | None = None
    database: str | None = None
    #: Why the catalogue could not be read (the pages say so), else None.
    error: str | None = None
    #: Seconds the reading took.
    read_seconds: float = 0.0
    #: Changes when anything a page shows changes (not with clocks and renewals).
    version: str = ""


@dataclass
class SchedulesKept:
    """The schedules' lean rows as last read, and the mark they were read under:
    a reading fetches them again only when the mark moved (or SCHEDULES_EVERY)."""
    mark: Any = None
    text: str | None = None
    read_at: float = -float("inf")
    #: ``text`` decoded (None until a reading decodes it): samples share the list,
    #: which pages only read.
    rows: list[dict[str, Any]] | None = None
    #: Full readings of the schedules (tests and the benchmark count them).
    reads: int = 0


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def fingerprint(sample: Sample, schedules_text: str = "") -> str:
    """The sample's version. The schedules hold no clock, so their text as the
    database sent it stands for them (hashing 10,000 rows' text costs a millisecond;
    walking them would cost a hundred)."""
    content = {"holders": sample.holders, "leases": sample.leases, "members": sample.members,
               "terms": sample.terms, "error": sample.error}
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps(_strip(content), sort_keys=True, default=str).encode())
    digest.update(schedules_text.encode() if schedules_text else
                  json.dumps(sample.schedules, sort_keys=True, default=str).encode())
    return digest.hexdigest()


async def read_sample(reader: Reader, *, with_terms: bool | None,
                      kept: SchedulesKept | None = None) -> tuple[Sample, bool | None]:
    """Read everything once. ``with_terms``: whether the history is installed (None:
    not known yet, asked). ``kept``: the schedules of the last reading, fetched again
    only when their mark moved (None: always). Returns the sample and what is now
    known about the history. A failure is recorded in the sample, for the pages."""
    started = time.perf_counter()
    kept = kept if kept is not None else SchedulesKept()
    try:
        raw_text = await reader.value(query("web_sample"))
        mark = await reader.value(query("web_schedules_mark"))
        if kept.text is None or mark != kept.mark or time.monotonic() - kept.read_at >= SCHEDULES_EVERY:
            read_at = time.monotonic()
            kept.text, kept.rows = await reader.value(query("web_schedules")), None
            kept.mark, kept.read_at, kept.reads = mark, read_at, kept.reads + 1
        schedules_text = kept.text
        if with_terms is None:
            with_terms = bool(await reader.value(query("web_terms_installed")))
        terms_text = await reader.value(query("web_terms"), (TERMS_SHOWN,)) if with_terms else None
    except Exception as exc:
        kept.text, kept.rows = None, None
        sample = Sample(now=dt.datetime.now(dt.UTC), error=_explain(exc))
        sample.read_seconds = time.perf_counter() - started
        sample.version = fingerprint(sample)
        return sample, None
    # Megabytes of JSON at 10,000 schedules: decoded off the event loop, which serves pages.
    sample = await asyncio.to_thread(_decode, raw_text, schedules_text, terms_text, kept)
    sample.read_seconds = time.perf_counter() - started
    return sample, with_terms


def _decode(raw_text: str, schedules_text: str, terms_text: str | None,
            kept: SchedulesKept) -> Sample:
    raw = json.loads(raw_text)
    if kept.rows is None or kept.text is not schedules_text:
        kept.rows = [dict(zip(SCHEDULE_FIELDS, r, strict=True)) for r in json.loads(schedules_text)]
    sample = Sample(
        now=dt.datetime.fromisoformat(raw["now"]), holders=raw["holders"], leases=raw["leases"],
        members=raw["members"], schedules=kept.rows,
        terms=None if terms_text is None else json.loads(terms_text),
        server_version=raw["server_version"], database=raw["database"],
    )
    sample.version = fingerprint(sample, schedules_text)
    return sample


def _explain(exc: BaseException) -> str:
    # A refused statement reads as the driver's error, as it did before Reader wrapped it.
    return explain(exc.__cause__ if isinstance(exc, DatabaseError) and exc.__cause__ else exc)
