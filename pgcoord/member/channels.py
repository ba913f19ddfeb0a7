"""The channels a member LISTENs to on its main session, and whom each one calls.

Before PostgreSQL 19 every NOTIFY's commit signals every listening session of the
database, whatever its channel: so the member listens only to what some feature
wants now, and stops listening as soon as nobody does (docs/members.md, "What a
member costs").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from .._drivers.dedicated import HolderConnection
from .._drivers.listen import listen
from .._drivers.listen import unlisten as stop_listening
from .._drivers.protocol import Unlisten

log = logging.getLogger("pgcoord.member")


class Channels:
    """Channel -> callbacks, what the current session LISTENs to, and how to stop each."""

    def __init__(self, member_name: str) -> None:
        self._name = member_name
        self._callbacks: dict[str, list[Callable[[str], None]]] = {}
        #: Channels LISTENed to on the current session.
        self.listening: set[str] = set()
        self._unlistens: dict[str, Unlisten] = {}

    def add(self, channel: str, callback: Callable[[str], None]) -> Callable[[], bool]:
        """Call ``callback`` for each NOTIFY on ``channel``; returns its removal, which
        says whether the channel is left with no callback."""
        callbacks = self._callbacks.setdefault(channel, [])
        callbacks.append(callback)

        def remove() -> bool:
            if callback not in callbacks:
                return False
            callbacks.remove(callback)
            return not callbacks

        return remove

    def registered(self) -> dict[str, int]:
        """How many callbacks each channel has (for tests and debugging)."""
        return {channel: len(callbacks) for channel, callbacks in self._callbacks.items()}

    def wanted(self) -> bool:
        """Whether any feature listens (besides membership news)."""
        return any(self._callbacks.values())

    async def listen_first(self, main: HolderConnection, channel: str,
                           callback: Callable[[str], None]) -> None:
        """LISTEN on a session before it is in use (a join's membership news)."""
        self._unlistens[channel] = await listen(main, channel, callback)

    def new_session(self) -> None:
        """A session was just set up: it listens to what ``listen_first`` did."""
        self.listening = set(self._unlistens)

    def session_gone(self) -> None:
        self._unlistens = {}

    async def step(self, main: HolderConnection, base: str | None,
                   on_base: Callable[[str], None]) -> str | None:
        """One LISTEN or UNLISTEN towards what is wanted now (``base``: the membership
        channel too, called with ``on_base``); returns the channel newly listened to
        or let go of, None when there is nothing left to do."""
        needed = {c for c, callbacks in self._callbacks.items() if callbacks}
        if base is not None:
            needed.add(base)
        todo, done = needed - self.listening, self.listening - needed
        if todo:
            channel = todo.pop()
            callback = (on_base if channel == base
                        else functools.partial(self._call, channel))
            self._unlistens[channel] = await listen(main, channel, callback)
            self.listening.add(channel)
            return channel
        if done:
            channel = done.pop()
            self.listening.discard(channel)
            unlisten = self._unlistens.pop(channel, None)
            if unlisten is not None:
                await stop_listening(main, channel, unlisten)
            return channel
        return None

    def _call(self, channel: str, payload: str) -> None:
        for callback in list(self._callbacks.get(channel, ())):
            try:
                callback(payload)
            except Exception:
                log.exception("member %r: a listener on %r failed", self._name, channel)
