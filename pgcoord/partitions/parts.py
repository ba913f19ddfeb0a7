"""A part and what its owner keeps of it: ``Partition`` (what ``own()`` is given),
the holding behind it, and the checks on what ``Partitions`` is given."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..leases.tenure import Tenure

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
    """A part this session holds: its tenure (fence, trust window, loss) and its
    own() task."""

    __slots__ = ("draining", "part", "stopping", "task", "tenure", "told")

    def __init__(self, part: Partition, tenure: Tenure) -> None:
        self.part = part
        self.tenure = tenure
        self.task: asyncio.Task[None] | None = None
        self.draining = False
        self.stopping = False  # pgcoord cancelled its own(): an error now is not a failure
        self.told = False  # logged that its own() went on after a cancellation

    @property
    def trust_until(self) -> float:
        return self.tenure.trust.until

    @property
    def lost(self) -> bool:
        """Another member may own the part now (our session ended, the part was taken
        over, or its trust window closed while we served). Its own() is then
        cancelled until it ends; a part given up in good order is cancelled once."""
        return self.tenure.lost is not None


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
