"""The one reader and sampler of a process per database source, shared by every
dashboard app over that source (DESIGN §12: the catalogue is read at most once a
second per process, whatever the number of apps and open pages).

An entry is keyed by the source (a DSN by its text, a pool or engine by identity)
and the event loop that serves it: a pool and the sampler's tasks belong to one
loop, so two servers on two loops (threads) cannot share one. Apps take a share on
first use and give it back at shutdown; the last one out stops the sampler and
closes the pool the dashboard opened.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .reader import Reader
from .sample import Sample, SchedulesKept, read_sample
from .sampler import Sampler

_Key = tuple[Any, asyncio.AbstractEventLoop]
_entries: dict[_Key, Shared] = {}


class Shared:
    def __init__(self, key: _Key, source: Any) -> None:
        self.key = key
        self.source = source  # held, so that id() of a pool is not reused while here
        self.reader = Reader(source)
        self.sampler = Sampler(self._read)
        self.users: set[int] = set()
        self._with_terms: bool | None = None
        self.kept = SchedulesKept()

    async def _read(self) -> Sample:
        sample, self._with_terms = await read_sample(self.reader, with_terms=self._with_terms,
                                                    kept=self.kept)
        return sample

    async def aclose(self) -> None:
        await self.sampler.stop()
        await self.reader.aclose()


def _key(source: Any, loop: asyncio.AbstractEventLoop) -> _Key:
    return (("dsn", source) if isinstance(source, str) else ("object", id(source)), loop)


def acquire(source: Any, user: object) -> Shared:
    """The entry of ``source`` on the running loop, with ``user`` counted in it."""
    key = _key(source, asyncio.get_running_loop())
    entry = _entries.get(key)
    if entry is None:
        entry = _entries[key] = Shared(key, source)
    entry.users.add(id(user))
    return entry


async def release(entry: Shared, user: object) -> None:
    """``user`` is done with ``entry``; the last user stops it. Must run on the
    entry's loop (else the entry is only forgotten: its loop is gone or elsewhere)."""
    entry.users.discard(id(user))
    if entry.users or _entries.get(entry.key) is not entry:
        return
    del _entries[entry.key]
    try:
        same_loop = asyncio.get_running_loop() is entry.key[1]
    except RuntimeError:
        same_loop = False
    if same_loop:
        await entry.aclose()


def live(entry: Shared) -> bool:
    return _entries.get(entry.key) is entry


def forget(entry: Shared, user: object) -> None:
    """``user`` left ``entry``'s loop for another: its share there is dropped, and
    the entry with it if it was the last (that loop's tasks ended with its server)."""
    entry.users.discard(id(user))
    if not entry.users and live(entry):
        del _entries[entry.key]


def entries() -> list[Shared]:
    """Every entry now in use in this process (tests and the benchmark look)."""
    return list(_entries.values())
