# Generated from pgcoord/locks/txscope/_async/scoped.py by tools/generate_sync.py: do not edit.
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
from ...._drivers import fetchval_on_sync, release_sync, reports_hot_standby, tx_session_sync
from ...._drivers.adapt import is_pool_timeout
from ...._drivers.base import SyncTxSession
from ....errors import PgcoordError, PoolExhausted
from ....observability import metrics
from ..base import TxScoped


class SyncTxScoped(TxScoped):
    def __enter__(self) -> Any:
        retries = self._dead_retries()
        asked = time.monotonic()
        deadline = self._deadline(asked)
        while True:
            session = self._start(tx_session_sync)
            try:
                conn = session.checkout()
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
                    self._refuse_standby_sync(session)
                if self._needs_record():
                    self._record_sync(session)
                if self._joined:
                    self._take_joined_sync(session, deadline)
                else:
                    self._take_sync(session, deadline)
            except BaseException as exc:
                self._session = None
                release_sync(session, rollback=not self._joined)
                if retries and self._found_dead(session, exc):
                    retries -= 1
                    self._retrying(exc)
                    continue
                self.request.raise_translated(exc)
            break
        self.wait_seconds = time.monotonic() - started
        metrics.lock_wait(self.request.metric_name, self.wait_seconds)
        return conn

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Every way out ends in _end_async(): a rollback and a give-back bounded by
        # CLEANUP_TIMEOUT that leave the caller its own outcome.
        assert self._session is not None
        session, self._session = cast(SyncTxSession, self._session), None
        if self._joined:
            return  # what was taken belongs to the caller's transaction
        if exc_type is not None:
            self._end_sync(session, rollback=True)
            return
        try:
            session.settle()  # the body's statements may still be queued
        except BaseException:
            self._end_sync(session, rollback=True)
            raise
        if not session.in_transaction():
            # The body ended the transaction itself, and so let go of what was taken.
            self._end_sync(session, rollback=True)
            raise self.request.ended_early()
        try:
            # Not bounded: the COMMIT is the body's own outcome, and may wait
            # (deferred triggers) as long as any statement of the body.
            session.commit()
        except BaseException:
            self._end_sync(session, rollback=True)
            raise
        self._end_sync(session, rollback=False)

    def _refuse_standby_sync(self, session: SyncTxSession) -> None:
        """A lock on a hot standby excludes only the standby's own sessions. The
        server's report is its last answer's: a standby promoted since says so at
        its next statement, which this is (in the caller's transaction when the
        lock joins it: SQLAlchemy refuses a transaction of pgcoord's own there)."""
        if self._joined:
            in_recovery = fetchval_on_sync(session.conn, query("server_in_recovery"), ())
        else:
            row = session.run_autocommit(query("server_in_recovery"), ())
            in_recovery = row is not None and row[0]
        if in_recovery:
            raise PgcoordError(_errmap.STANDBY_MESSAGE)

    def _record_sync(self, session: SyncTxSession) -> None:
        sql, params = self._record_statement()
        try:
            session.run_autocommit(sql, params)
        except Exception as exc:  # best effort: missing schema, no privilege, read-only
            if _errmap.session_gone(exc):
                raise  # a dead connection: asked for again on another
            self._not_recorded(exc)
        self._recorded()

    @abstractmethod
    def _take_joined_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        """Take it inside the caller's transaction (in a savepoint)."""

    @abstractmethod
    def _take_sync(self, session: SyncTxSession, deadline: float | None) -> None:
        """Open a transaction that holds it."""

    @abstractmethod
    def _end_sync(self, session: SyncTxSession, *, rollback: bool) -> None:
        """After the transaction that held it: roll back (when asked) and give the
        connection back, bounded."""
