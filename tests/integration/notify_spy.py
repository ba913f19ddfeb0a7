"""Count the NOTIFYs pgcoord sends: a session that LISTENs to every pgcoord channel
*without* registering as a listener (``pgcoord.ears_open``), so that it hears what
the server really sends and never makes pgcoord send more. Used by
test_notify_budget.py and bench/notify_count.py.

A NOTIFY's cost does not depend on who hears it: every listening session of the
database is signalled and the commit serializes on a database-wide lock. So what
this spy hears is what an application's own traffic pays for.
"""

from __future__ import annotations

import time
from collections import Counter

import psycopg

CHANNELS = ("pgcoord_leases", "pgcoord_members", "pgcoord_schedules", "pgcoord_semaphores",
            "pgcoord_partitions")


class NotifySpy:
    """``with NotifySpy(dsn) as spy: ...; spy.take()`` -> Counter of channel -> NOTIFYs."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.heard: list[tuple[str, str]] = []
        self._conn: psycopg.Connection | None = None

    def __enter__(self) -> NotifySpy:
        self._conn = psycopg.connect(self.dsn, autocommit=True)
        for channel in CHANNELS:
            self._conn.execute(f'LISTEN "{channel}"')
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.close()

    def drain(self, quiet: float = 0.3) -> None:
        """Collect what arrives until ``quiet`` seconds pass with nothing new."""
        conn = self._conn
        assert conn is not None
        deadline = time.monotonic() + quiet
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for notify in conn.notifies(timeout=left, stop_after=1):
                self.heard.append((notify.channel, notify.payload))
                deadline = time.monotonic() + quiet

    def take(self, quiet: float = 0.3) -> Counter[str]:
        """The NOTIFYs heard since the last take, by channel."""
        self.drain(quiet)
        counts = Counter(channel for channel, _ in self.heard)
        self.heard.clear()
        return counts
