"""One reading of the catalogue: what every page is drawn from."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from .._core.queries import query
from .reader import Reader

#: How many terms of each lease name the elections page shows.
TERMS_SHOWN = 5

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
    #: The rows of the ``schedule_list`` query (``pgcoord jobs --json`` before next runs).
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


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def fingerprint(sample: Sample) -> str:
    content = {"holders": sample.holders, "leases": sample.leases, "members": sample.members,
               "schedules": sample.schedules, "terms": sample.terms, "error": sample.error}
    text = json.dumps(_strip(content), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


async def read_sample(reader: Reader, *, with_terms: bool | None) -> tuple[Sample, bool | None]:
    """Read everything once. ``with_terms``: whether the history is installed (None:
    not known yet, asked). Returns the sample and what is now known about it. A
    failure is recorded in the sample, for the pages to show."""
    started = time.perf_counter()
    try:
        raw = json.loads(await reader.value(query("web_sample")))
        row = await reader.row(query("schedule_list"), (None,))
        assert row is not None
        schedules = json.loads(row[1]) if isinstance(row[1], str) else row[1]
        if with_terms is None:
            with_terms = bool(await reader.value(query("web_terms_installed")))
        terms = None
        if with_terms:
            terms = json.loads(await reader.value(query("web_terms"), (TERMS_SHOWN,)))
    except Exception as exc:
        sample = Sample(now=dt.datetime.now(dt.UTC), error=_explain(exc))
        sample.read_seconds = time.perf_counter() - started
        sample.version = fingerprint(sample)
        return sample, None
    sample = Sample(
        now=dt.datetime.fromisoformat(raw["now"]), holders=raw["holders"], leases=raw["leases"],
        members=raw["members"], schedules=schedules, terms=terms,
        server_version=raw["server_version"], database=raw["database"],
    )
    sample.read_seconds = time.perf_counter() - started
    sample.version = fingerprint(sample)
    return sample, with_terms


def _explain(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {text}"
