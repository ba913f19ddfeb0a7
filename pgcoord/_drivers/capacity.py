"""How many connections a pool or engine can lend at once, for features that
need one beside what the caller holds (lease renewals, job heartbeats)."""

from __future__ import annotations

from typing import Any

from .adapt import find_adapter


def pool_capacity(source: Any) -> int | None:
    """The most connections ``source`` (a pool or engine) can have out at once, or
    None when it sets no bound that pgcoord can read (or is no pool)."""
    found = find_adapter(source)
    return None if found is None else found.pool_capacity(source)
