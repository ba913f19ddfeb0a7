"""A half of ``exclusive()``: ``async with`` in ``_async/`` (written by hand), ``with``
in ``_sync/`` (generated). One statement takes the lock: ``pg_advisory_xact_lock``
or its shared or ``try`` form, which the server releases at commit or rollback."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...._drivers import release_async
from ...._drivers.base import AsyncTxSession
from .scoped import AsyncTxScoped

if TYPE_CHECKING:
    from ...advisory import LockRequest


class AsyncExclusive(AsyncTxScoped):
    request: LockRequest

    async def _take_joined_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        await session.lock_in_savepoint(self.request.statement)

    async def _take_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        await session.begin_locked(self.request.statement)

    async def _end_async(self, session: AsyncTxSession, *, rollback: bool) -> None:
        await release_async(session, rollback=rollback)
