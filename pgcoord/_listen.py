"""LISTEN on a dedicated connection, for asyncpg and psycopg alike.

asyncpg delivers a notification as soon as it arrives. psycopg delivers them
when it reads from the socket: during a statement, or from the idle-socket
watch of ``_holderconn`` (which reads what arrives while nothing runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._holderconn import HolderConnection


async def listen(conn: HolderConnection, channel: str, callback: Callable[[str], None]) -> None:
    """LISTEN on ``channel`` and call ``callback(payload)`` for each notification."""
    driver_conn: Any = getattr(conn, "conn", None)
    module = type(driver_conn).__module__.partition(".")[0]
    if module == "asyncpg":
        await driver_conn.add_listener(channel, lambda _c, _pid, _ch, payload: callback(payload))
        return
    if module == "psycopg":
        def on_notify(notify: Any) -> None:
            if notify.channel == channel:
                callback(notify.payload)

        driver_conn.add_notify_handler(on_notify)
        await conn.execute(f'LISTEN "{channel}"')
        return
    raise TypeError(f"cannot LISTEN on a {type(driver_conn).__qualname__}")
