"""One LISTEN for membership news per process and database, shared by its members.

Before PostgreSQL 19 a NOTIFY's commit signals every listening session of the
database, and each signalled backend wakes its client. A process whose ten members
each ``watch()`` the group listened on ten sessions; a crash's one NOTIFY then went
to ten sessions in every process, and on a loaded host the last of them heard it
well after the reap (docs/performance.md, "Crash news": p99 100-155 ms with 190
listening sessions, 76 ms with 19).

So the members of one process (one event loop) that need membership news from one
database share one listening session: the main session of one of them, the
*carrier*. What the carrier hears is handed to every member of the hub. When the
carrier's session is lost, or it no longer needs news, another member carries; once
its LISTEN is in place every other member reads the group afresh, because news sent
in between reached nobody.
"""

from __future__ import annotations

import weakref
from asyncio import AbstractEventLoop, get_running_loop
from typing import Protocol


class NewsReader(Protocol):
    """What a hub asks of a member."""

    def on_news(self, payload: str) -> None:
        """A NOTIFY on the membership channel (called in the event loop)."""

    def catch_up(self) -> None:
        """Read the group afresh soon: news may have been missed."""

    def can_carry(self) -> bool:
        """Whether the member has a live, listening-capable session right now."""


class NewsHub:
    """The members of one process that need membership news from one database."""

    def __init__(self) -> None:
        #: Members that hear news through the hub (ordered by when they came).
        self._readers: dict[NewsReader, None] = {}
        self.carrier: NewsReader | None = None

    def has(self, reader: NewsReader) -> bool:
        return reader in self._readers

    def register(self, reader: NewsReader) -> bool:
        """``reader`` hears news from now on; True if it did not before (it then
        reads the group once the hub is known to listen, to catch up)."""
        if reader in self._readers:
            return False
        self._readers[reader] = None
        return True

    def unregister(self, reader: NewsReader) -> None:
        """``reader`` no longer needs news, or lost its session. A carrier hands
        over to the first member that can carry."""
        self._readers.pop(reader, None)
        if self.carrier is reader:
            self.carrier = None
            self._hand_over()

    def carries(self, reader: NewsReader) -> bool:
        """Whether ``reader``'s session should LISTEN for the hub: it carries, or
        nobody does and it can (it becomes the carrier)."""
        if self.carrier is None and reader in self._readers and reader.can_carry():
            self.carrier = reader
        return self.carrier is reader

    def listening(self, carrier: NewsReader) -> None:
        """``carrier``'s LISTEN is in place: whatever was sent before it reached the
        other members only if an earlier carrier heard it, so they read afresh."""
        if carrier is self.carrier:
            for reader in list(self._readers):
                if reader is not carrier:
                    reader.catch_up()

    def dispatch(self, payload: str) -> None:
        """The carrier heard ``payload``: every member hears it."""
        for reader in list(self._readers):
            reader.on_news(payload)

    def _hand_over(self) -> None:
        for reader in self._readers:
            if reader.can_carry():
                self.carrier = reader
                reader.catch_up()  # its news loop reads, then LISTENs (``Member._listen_all``)
                return


#: Event loop -> database (its DSN) -> hub. Weak on the loop: a closed loop's hubs go.
_hubs: weakref.WeakKeyDictionary[AbstractEventLoop, dict[str, NewsHub]] = weakref.WeakKeyDictionary()


def hub_for(dsn: str) -> NewsHub:
    """The hub of the running event loop for the database ``dsn`` names."""
    return _hubs.setdefault(get_running_loop(), {}).setdefault(dsn, NewsHub())
