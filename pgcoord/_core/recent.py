"""A bounded set of what this process did recently, for work done once per key.

pgcoord records a lock's name (and a semaphore's size) the first time a process
uses it, and remembers that it did so, to spare later uses the round trip. An
application that locks per entity (``exclusive(pool, f"order:{id}")``) uses each
name a few times and then never again; an unbounded set would grow for the life
of the process. Past ``capacity`` the least recently used key is forgotten: its
next use records it again (an ``INSERT ... ON CONFLICT DO NOTHING``, one round
trip), which is the price of the bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class RecentSet(Generic[K]):
    """The last ``capacity`` keys added or looked up; thread-safe (sync locks run
    on many threads)."""

    __slots__ = ("_guard", "_keys", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._keys: OrderedDict[K, None] = OrderedDict()
        self._guard = threading.Lock()

    def __contains__(self, key: object) -> bool:
        with self._guard:
            if key not in self._keys:
                return False
            self._keys.move_to_end(key)  # type: ignore[arg-type]
            return True

    def add(self, key: K) -> None:
        with self._guard:
            self._keys[key] = None
            self._keys.move_to_end(key)
            while len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def __len__(self) -> int:
        with self._guard:  # not mid-way through another thread's add
            return len(self._keys)
