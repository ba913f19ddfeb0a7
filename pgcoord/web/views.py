"""Rendering: the Jinja2 environment, its filters, and the shared page frame."""

from __future__ import annotations

import datetime as dt
import json
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import quote

import jinja2

from .model import when


def age(seconds: float | None) -> str:
    """3.2s, 4m, 1.5h, 2.0d: short enough for a table cell."""
    if seconds is None:
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m {seconds % 60:02.0f}s"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def moment(value: str | dt.datetime | None) -> str:
    at = when(value)
    if at is None:
        return "-"
    return at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def iso(value: str | dt.datetime | None) -> str:
    at = when(value)
    return "" if at is None else at.isoformat()


def segment(name: str) -> str:
    """A name as one path segment: every reserved character escaped, '/' too."""
    return quote(name, safe="")


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("pgcoord.web", "templates"),
        autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
    )
    env.filters.update(age=age, moment=moment, iso=iso, segment=segment,
                       tojson_pretty=lambda v: json.dumps(v, indent=2, sort_keys=True, default=str))
    return env


@cache
def static_file(name: str) -> bytes:
    return resources.files("pgcoord.web").joinpath("static", name).read_bytes()


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)
