# Generated from pgcoord/locks/txscope/_async/exclusive.py by tools/generate_sync.py: do not edit.
"""A half of ``exclusive()``: ``async with`` in ``_async/`` (written by hand), ``with``
in ``_sync/`` (generated). One statement takes the lock: ``pg_advisory_xact_lock``
or its shared or ``try`` form, which the server releases at commit or rollback."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...._drivers import release_sync
from ...._drivers.base import SyncTxSession
from .scoped import SyncTxScoped

if TYPE_CHECKING:
    from ...advisory import LockRequest


class SyncExclusive(SyncTxScoped):
    request: LockRequest

    def _take_joined_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        session.lock_in_savepoint(self.request.statement)

    def _take_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        session.begin_locked(self.request.statement)

    def _end_sync(self, session: SyncTxSession, *, rollback: bool) -> None:
        release_sync(session, rollback=rollback)
