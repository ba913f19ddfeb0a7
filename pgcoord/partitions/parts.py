"""A part and what its owner keeps of it: ``Partition`` (what ``own()`` is given),
the holding behind it, and the checks on what ``Partitions`` is given."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

MAX_COUNT = 4096


@dataclass(frozen=True)
class Partition:
    """One part while this member owns it: ``name`` is ``"<partitions>/<index>"``,
    the lease whose current ``fence`` this ownership holds."""

    index: int
    name: str
    fence: int


Own = Callable[[Partition], Awaitable[Any]]


class _Held:
    """A part this session holds: its fence, its trust window and its own() task."""

    __slots__ = ("draining", "lost", "part", "stopping", "task", "told", "trust_until")

    def __init__(self, part: Partition, trust_until: float) -> None:
        self.part = part
        self.trust_until = trust_until
        self.task: asyncio.Task[None] | None = None
        self.draining = False
        # Lost: another member may own the part now (our session ended, the part was
        # taken over, or its trust window closed while we served). Its own() is then
        # cancelled until it ends; a part given up in good order is cancelled once.
        self.lost = False
        self.stopping = False  # pgcoord cancelled its own(): an error now is not a failure
        self.told = False  # logged that its own() went on after a cancellation


class _SessionGone(Exception):
    pass


# Names of the partitionings running on each member: one per name, since two would
# share the member's session, its doorbells and its participation lock.


def _validate(member: Any, name: Any, count: Any) -> None:
    from ..member import Member

    if not isinstance(member, Member):
        raise TypeError(f"Partitions takes a pgcoord.Member, not {type(member).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name or len(name) > 200:
        raise ValueError("name must be 1 to 200 characters")
    if "\x00" in name:
        raise ValueError("name must not contain a NUL character (PostgreSQL text cannot hold one)")
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"count must be an int, not {type(count).__name__}")
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"count must be between 1 and {MAX_COUNT}, got {count}")
