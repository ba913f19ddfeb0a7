"""The private member of a ``Scheduler(pool)`` given neither ``member=`` nor ``runner=``.

Claims tied to a member's session end with it: when a replica dies, every other
replica hears of it at once (the member's watcher) and expires its running claims,
so the next slot of a job runs within a second instead of being skipped (overlap)
until ``claim_ttl`` runs out. The README's form, ``Scheduler(pool)``, gets that too:
it opens a member of its own (two sessions, outside the pool) from the pool's own
connection parameters (``_drivers/pool_dsn.py``), as ``Elector(dsn)`` opens its own
session, for the length of each ``run()``.

Behind a transaction-mode pooler the member falls back to heartbeat rows by itself
(a departure is then heard within its ttl and a third). When the member cannot be
opened — parameters no DSN holds (an ``ssl.SSLContext``), the server refusing it —
the scheduler says why and runs on untied (each claim then ends when it expires),
trying again now and then; it never fails ``run()`` for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._core.aio import Backoff, Supervisor
from .._drivers.pool_dsn import pool_dsn
from ..errors import UnsupportedConnection
from ..member import Member

log = logging.getLogger("pgcoord.scheduler")

#: How long run() waits for the member's first join before running untied meanwhile
#: (a join takes a few round trips; a slower one, a server under load, must not hold
#: up the first ticks for long: claims made meanwhile are untied, and cost claim_ttl
#: only if this replica crashes before its member has joined).
FIRST_JOIN_TIMEOUT = 1.0
GROUP = "pgcoord.scheduler"


class OwnMember:
    """The private member for a ``run()``: opened by ``open()``, closed by ``close()``."""

    def __init__(self, source: Any, name: str) -> None:
        self._source = source
        self._name = name
        #: The member while open and joined once; None before (claims then carry
        #: the scheduler's plain runner name, untied).
        self.member: Member | None = None
        self._tasks = Supervisor("scheduler private member", log)

    async def open(self, joined: Callable[[Member], Awaitable[None]]) -> None:
        """Join (waiting at most FIRST_JOIN_TIMEOUT); on failure go on trying in the
        background. ``joined(member)`` is awaited once it has."""
        try:
            dsn, driver = pool_dsn(self._source)
        except UnsupportedConnection as exc:
            log.warning("scheduler: no private member, so its claims are not tied to a session (a "
                        "crashed replica's running slots wait for their claim_ttl): %s; pass "
                        "member=pgcoord.Member(dsn) to tie them", exc)
            return
        attempt = self._tasks.spawn(self._join(dsn, driver, joined), "pgcoord-scheduler-member-open",
                                    collected=True)
        await asyncio.wait({attempt}, timeout=FIRST_JOIN_TIMEOUT)

    async def _join(self, dsn: str, driver: str, joined: Callable[[Member], Awaitable[None]]) -> None:
        backoff = Backoff(first=1.0, cap=30.0)
        while True:
            member = Member(dsn, group=GROUP, name=self._name, driver=driver,
                            application_name=f"pgcoord-scheduler:{self._name}")
            try:
                await member.open()
            except Exception as exc:
                delay = backoff.failed()
                log.warning("scheduler: opening its private member from the pool's connection "
                            "parameters failed (%r); running with claims not tied to a session "
                            "meanwhile, trying again in about %.0f s (or pass member=)", exc, delay)
                await backoff.sleep()
                continue
            self.member = member
            await joined(member)
            return

    async def close(self) -> None:
        await self._tasks.stop()
        member, self.member = self.member, None
        if member is not None:
            await member.close()
