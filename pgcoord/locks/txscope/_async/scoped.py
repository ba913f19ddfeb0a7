"""The steps that ``exclusive()`` and ``semaphore()`` have in common, in one half:
``async with`` in ``_async/`` (written by hand), ``with`` in ``_sync/`` (generated).

Check a connection out (or take the caller's), take the lock or slot in a
transaction of its own or in a savepoint of the caller's, hand the body the
connection, and end the transaction on the way out. A pooled connection that turns
out dead before anything was taken is replaced by another.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from types import TracebackType
from typing import Any, cast

from ...._core import errmap as _errmap
from ...._core.queries import query
from ...._drivers import fetchval_on, release_async, reports_hot_standby, tx_session_async
from ...._drivers.adapt import is_pool_timeout
from ...._drivers.base import AsyncTxSession
from ....errors import PgcoordError, PoolExhausted
from ....observability import metrics
from ..base import TxScoped


class AsyncTxScoped(TxScoped):
    async def __aenter__(self) -> Any:
        retries = self._dead_retries()
        asked = time.monotonic()
        deadline = self._deadline(asked)
        while True:
            session = self._start(tx_session_async)
            try:
                conn = await session.checkout()
            except BaseException as exc:
                self._session = None  # nothing checked out: it may be entered again
                # A builtin TimeoutError is a connect that timed out (pgcoord gives
                # asyncpg's pool no timeout of its own), not a pool with none to lend.
                if isinstance(exc, Exception) and not isinstance(exc, TimeoutError) \
                        and is_pool_timeout(exc):
                    raise PoolExhausted(
                        f"{self.CALL}: the pool lent no connection within its own timeout: "
                        "every connection was in use, or a new one could not be made in "
                        "time (the pool's exception, the cause, may say which)"
                    ) from exc
                raise
            started = asked if self.WAIT_FROM_CALL else time.monotonic()
            try:
                self._joined = session.in_transaction()
                if reports_hot_standby(session.driver_connection()):
                    await self._refuse_standby_async(session)
                if self._needs_record():
                    await self._record_async(session)
                if self._joined:
                    await self._take_joined_async(session, deadline)
                else:
                    await self._take_async(session, deadline)
            except BaseException as exc:
                self._session = None
                await release_async(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    self._retrying(exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.metric_name, self.wait_seconds)
        return conn

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every way out ends in _end_async(): a rollback and a give-back bounded by
        # CLEANUP_TIMEOUT that leave the caller its own outcome.
        assert self._session is not None
        session, self._session = cast(AsyncTxSession, self._session), None
        if self._joined:
            return  # what was taken belongs to the caller's transaction
        if exc_type is not None:
            await self._end_async(session, rollback=True)
            return
        try:
            await session.settle()  # the body's statements may still be queued
        except BaseException:
            await self._end_async(session, rollback=True)
            raise
        if not session.in_transaction():
            # The body ended the transaction itself, and so let go of what was taken.
            await self._end_async(session, rollback=True)
            raise self.request.ended_early()
        try:
            # Not bounded: the COMMIT is the body's own outcome, and may wait
            # (deferred triggers) as long as any statement of the body.
            await session.commit()
        except BaseException:
            await self._end_async(session, rollback=True)
            raise
        await self._end_async(session, rollback=False)

    async def _refuse_standby_async(self, session: AsyncTxSession) -> None:
        """A lock on a hot standby excludes only the standby's own sessions. The
        server's report is its last answer's: a standby promoted since says so at
        its next statement, which this is (in the caller's transaction when the
        lock joins it: SQLAlchemy refuses a transaction of pgcoord's own there)."""
        if self._joined:
            in_recovery = await fetchval_on(session.conn, query("server_in_recovery"), ())
        else:
            row = await session.run_autocommit(query("server_in_recovery"), ())
            in_recovery = row is not None and row[0]
        if in_recovery:
            raise PgcoordError(_errmap.STANDBY_MESSAGE)

    async def _record_async(self, session: AsyncTxSession) -> None:
        sql, params = self._record_statement()
        try:
            await session.run_autocommit(sql, params)
        except Exception as exc:  # best effort: missing schema, no privilege, read-only
            if _errmap.session_gone(exc):
                raise  # a dead connection: asked for again on another
            self._not_recorded(exc)
        self._recorded()

    @abstractmethod
    async def _take_joined_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        """Take it inside the caller's transaction (in a savepoint)."""

    @abstractmethod
    async def _take_async(self, session: AsyncTxSession, deadline: float | None) -> None:
        """Open a transaction that holds it."""

    @abstractmethod
    async def _end_async(self, session: AsyncTxSession, *, rollback: bool) -> None:
        """After the transaction that held it: roll back (when asked) and give the
        connection back, bounded."""
