"""Named runtime queries, parsed once from ``sql/queries.sql`` and the other
``*_queries.sql`` files beside it (one per concept).

Blocks start with ``-- name: <name>``; comment lines directly below the name are
documentation and are dropped. Bind parameters are written ``$1, $2, ...`` and
rewritten for drivers that spell them differently.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache

from .resources import read_sql

_NAME_LINE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_DOLLAR_PARAM = re.compile(r"\$(\d+)\b")


def parse(text: str) -> dict[str, str]:
    """Split ``text`` into ``{name: sql}``; raises ``ValueError`` on duplicates."""
    parts = _NAME_LINE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = body.strip().splitlines()
        while lines and lines[0].lstrip().startswith("--"):
            lines.pop(0)
        sql = "\n".join(lines).strip()
        if not sql:
            raise ValueError(f"query {name!r} is empty")
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = sql
    return queries


_FILES = (
    "queries.sql", "member_queries.sql", "partition_queries.sql", "testing_queries.sql",
    "schedule_queries.sql", "web_queries.sql",
)


@cache
def _all() -> dict[str, str]:
    queries: dict[str, str] = {}
    for filename in _FILES:
        for name, sql in parse(read_sql(filename)).items():
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice")
            queries[name] = sql
    return queries


def query(name: str) -> str:
    return _all()[name]


@lru_cache(maxsize=512)
def to_pyformat(sql: str) -> str:
    """``$1`` -> ``%s`` (psycopg). Parameters must appear in order, once each."""
    seen = [int(n) for n in _DOLLAR_PARAM.findall(sql)]
    if seen != list(range(1, len(seen) + 1)):
        raise ValueError("positional parameters must appear once each, in order")
    return _DOLLAR_PARAM.sub("%s", sql)


@lru_cache(maxsize=512)
def to_named(sql: str) -> str:
    """``$1`` -> ``:p1`` (SQLAlchemy ``text()``)."""
    return _DOLLAR_PARAM.sub(r":p\1", sql)
