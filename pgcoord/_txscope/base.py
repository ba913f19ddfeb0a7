"""What both halves of ``exclusive()`` and ``semaphore()`` share: the state of one
use, and the steps of it that do no I/O."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

from .. import _errmap
from .._drivers import check_source
from .._drivers.base import AsyncTxSession, SyncTxSession
from ..errors import PgcoordError

S = TypeVar("S", AsyncTxSession, SyncTxSession)


class TxRequest(Protocol):
    """What is asked for (``LockRequest``, ``SemaphoreRequest``): validated once."""

    @property
    def name(self) -> str | None: ...

    @property
    def metric_name(self) -> str: ...

    def describe(self) -> str: ...

    def raise_translated(self, exc: BaseException) -> NoReturn: ...

    def ended_early(self) -> PgcoordError: ...


class TxScoped(ABC):
    """One use of ``exclusive()`` or ``semaphore()``: single use at a time."""

    #: The call, for the error when one object is entered twice at once.
    CALL: str
    #: Whether ``wait_seconds`` counts from the call, the connection's checkout
    #: included (a semaphore, whose timeout bounds its whole wait), or from the
    #: checkout (a lock, whose wait is the server's).
    WAIT_FROM_CALL = False
    #: What a name is recorded as, in the debug record when that fails.
    RECORDS: str
    _log: logging.Logger

    def __init__(self, source: Any, request: TxRequest) -> None:
        check_source(source)
        self._source = source
        self.request = request
        self._session: AsyncTxSession | SyncTxSession | None = None
        self._joined = False
        #: Seconds spent waiting for the grant, set on entry (for metrics and logs).
        self.wait_seconds: float | None = None

    def _start(self, tx_session: Callable[[Any], S]) -> S:
        """A session from ``tx_session_async`` or ``tx_session_sync``, whose
        ``TypeError`` says which of ``async with`` and ``with`` to use."""
        if self._session is not None:
            raise RuntimeError(f"this {self.CALL} is already entered; create one per use")
        session = tx_session(self._source)
        self._session = session
        return session

    def _deadline(self, started: float) -> float | None:
        """When a wait that began at ``started`` gives up; None: never, or the server decides."""
        return None

    def _found_dead(self, session: AsyncTxSession | SyncTxSession, exc: BaseException) -> bool:
        """Whether the connection just checked out of a pool was already dead."""
        return session.pooled and not self._joined and _errmap.session_gone(exc)

    def _retrying(self, exc: BaseException) -> None:
        self._log.info("pgcoord: the pooled connection for %s was closed by the server (%r); "
                       "trying another", self._what(), exc)

    def _what(self) -> str:
        return self.request.describe()

    @abstractmethod
    def _needs_record(self) -> bool:
        """Whether the name is still to be recorded for ``pgcoord.holders`` (once per process)."""

    @abstractmethod
    def _record_statement(self) -> tuple[str, tuple[Any, ...]]: ...

    @abstractmethod
    def _recorded(self) -> None:
        """Remember that the name was recorded (or could not be: best effort)."""

    def _not_recorded(self, exc: BaseException) -> None:
        self._log.debug("%s %r not recorded: %s", self.RECORDS, self.request.name, exc)
