"""What both halves of ``exclusive()`` and ``semaphore()`` share: the state of one
use, and the steps of it that do no I/O."""

from __future__ import annotations

import functools
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, NoReturn, ParamSpec, Protocol, TypeVar, cast

from ..._core import errmap as _errmap
from ..._core.checks import LOCK_TIMEOUT_MAX
from ..._drivers import check_source
from ..._drivers.base import AsyncTxSession, SyncTxSession
from ...errors import PgcoordError

S = TypeVar("S", AsyncTxSession, SyncTxSession)
P = ParamSpec("P")
R = TypeVar("R")


def request_cache(build: Callable[P, R]) -> Callable[P, R]:
    """``build``, cached: requests are immutable and services reuse their keys, so each
    is validated once (``typed``: ``True`` stays apart from ``1``, which is refused).
    An unhashable argument builds one uncached, which raises the precise error."""
    cached = cast("Callable[P, R]", functools.lru_cache(maxsize=4096, typed=True)(build))

    @functools.wraps(build)
    def request(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return cached(*args, **kwargs)
        except TypeError:
            return build(*args, **kwargs)

    return request


def check_wait(wait: Any) -> None:
    if not isinstance(wait, bool):
        raise TypeError("wait must be a bool")


def check_timeout(timeout: Any, wait: bool) -> None:
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number of seconds, not {type(timeout).__name__}")
        # lock_timeout is an int of milliseconds: about 24.8 days at most.
        if not math.isfinite(timeout) or timeout < 0 or timeout > LOCK_TIMEOUT_MAX:
            raise ValueError(f"timeout must be a finite number of seconds from 0 to "
                             f"{LOCK_TIMEOUT_MAX:.0f}, got {timeout}")
        if not wait:
            raise ValueError("timeout has no meaning with wait=False")


def ended_early(held: str, it: str) -> PgcoordError:
    """The body committed or rolled back itself, and so let go of ``held`` mid-block."""
    return PgcoordError(
        f"the transaction holding {held} was ended inside the block (an explicit commit or "
        f"rollback), which released {it} there; let the block commit, or use a savepoint"
    )


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
    """One use of ``exclusive()`` or ``semaphore()``, single use at a time: with
    ``async with`` on an async source, ``with`` on a sync one (the other raises
    ``TypeError`` saying which to use). Its halves (``AsyncTxScoped`` and the
    generated ``SyncTxScoped``) are made one by the class that ``exclusive()`` or
    ``semaphore()`` returns, with what it takes and records."""

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

    def _dead_retries(self) -> int:
        """Tries on another connection after a dead pooled one: one per connection the
        pool may hold (idle_session_timeout ends all of an idle pool's at once), and
        at least DEAD_POOLED_RETRIES."""
        from ..._drivers.capacity import pool_capacity
        from . import DEAD_POOLED_RETRIES

        capacity = pool_capacity(self._source)
        return DEAD_POOLED_RETRIES if capacity is None else min(max(DEAD_POOLED_RETRIES, capacity), 12)

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
