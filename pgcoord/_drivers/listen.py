"""LISTEN on a dedicated session (``DedicatedSession.listen``; each driver's
session knows how it hears notifications)."""

from __future__ import annotations

from collections.abc import Callable

from .protocol import DedicatedSession


async def listen(conn: DedicatedSession, channel: str, callback: Callable[[str], None]) -> None:
    """LISTEN on ``channel`` and call ``callback(payload)`` for each notification."""
    await conn.listen(channel, callback)
