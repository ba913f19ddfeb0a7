"""LISTEN on a dedicated session (``DedicatedSession.listen``; each driver's
session knows how it hears notifications), registered as a listener first.

pgcoord tells news on its broadcast channels only when some session listens
(``pgcoord.notify_heard``, migration 0010): before PostgreSQL 19 every NOTIFY
signals every listening session of the database and serializes commits. So a
LISTEN on one of them is preceded by ``ears_open`` and an UNLISTEN followed by
``ears_close``; the register is a session lock, gone with the session.
"""

from __future__ import annotations

from collections.abc import Callable

from .._core.queries import query
from .protocol import DedicatedSession, Unlisten


async def open_ears(conn: DedicatedSession, channel: str) -> None:
    """Say that this session is about to listen to ``channel`` (before the LISTEN)."""
    await conn.fetchval(query("ears_open"), channel)


async def close_ears(conn: DedicatedSession, channel: str) -> None:
    """Say that this session no longer listens to ``channel`` (after the UNLISTEN)."""
    await conn.fetchval(query("ears_close"), channel)


async def listen(conn: DedicatedSession, channel: str, callback: Callable[[str], None]) -> Unlisten:
    """Register, then LISTEN on ``channel`` and call ``callback(payload)`` for each
    notification. ``unlisten`` undoes it."""
    await open_ears(conn, channel)
    return await conn.listen(channel, callback)


async def unlisten(conn: DedicatedSession, channel: str, forget: Unlisten) -> None:
    """Undo ``listen``: forget the callback, UNLISTEN, then leave the register."""
    await forget()
    await conn.execute(f'UNLISTEN "{channel}"')
    await close_ears(conn, channel)
