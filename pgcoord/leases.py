"""Leases with fencing tokens: ``Lease`` and ``check_fence``.

A lease is a row in ``pgcoord.leases``. Acquiring it bumps the row's fence;
renewing and releasing are scoped to the exact holder and fence, so nobody can
renew or release someone else's lease, and a lease that has expired in the
database is never renewed, not even by its last holder. Only the database clock
decides expiry. The holder keeps a *trust window* on its monotonic clock that
closes before the server would let anyone take over, and stops believing it
holds the lease when the window closes, also after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from types import TracebackType
from typing import Any

from . import _errmap, metrics
from ._aio import CLEANUP_TIMEOUT, absorb_cancel, consume_result, finish_despite_cancel
from ._drivers import (
    check_source,
    fetchval_on,
    fetchval_on_sync,
    is_async_connection,
    run_statement,
)
from ._queries import query
from .errors import LeaseLost, LockBusy, LockTimeout, StaleFence

__all__ = ["Lease", "check_fence", "default_holder", "trust_margin", "validate_holder"]

log = logging.getLogger("pgcoord.leases")

SQLSTATE_STALE_FENCE = "PC002"


def default_holder() -> str:
    """``host:pid:random``: unique per process and instance, readable by operators."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def trust_margin(window: float) -> float:
    """How much earlier than the server a holder stops believing: 10%, at most 1 s."""
    return min(window * 0.1, 1.0)


def validate_ttl(ttl: Any) -> float:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not math.isfinite(ttl) or ttl < 0.1:
        raise ValueError(f"ttl must be at least 0.1 s, got {ttl}")
    return float(ttl)


def validate_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"lease name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lease name must not be empty")
    return name


def validate_holder(holder: Any) -> str:
    """The holder name as given, or a default one; a non-empty str either way."""
    if holder is None:
        return default_holder()
    if not isinstance(holder, str) or not holder:
        raise ValueError("holder must be a non-empty str")
    return holder


class Lease:
    """A named lease with a fencing token; see DESIGN §3.

    ``async with Lease(pool, "invoice-run", ttl=10) as fence:`` waits to acquire,
    renews every ``ttl/3`` in the background, and cancels the body with
    ``LeaseLost`` when a renewal fails for good or the trust window closes.
    """

    def __init__(self, source: Any, name: str, *, ttl: float, holder: str | None = None) -> None:
        check_source(source, need_async=True)
        self.name = validate_name(name)
        self.ttl = validate_ttl(ttl)
        self.holder = validate_holder(holder)
        self._source = source
        self.fence: int | None = None
        self._trust_until = 0.0
        self._last_renewed = 0.0
        self._next_renewal = 0.0
        self._lost: str | None = None
        self._renewer: asyncio.Task[None] | None = None
        self._body: asyncio.Task[Any] | None = None
        metrics.warm_up()

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl * 1000)

    @property
    def valid(self) -> bool:
        """True inside the local trust window of a held lease."""
        return self.fence is not None and self._lost is None and time.monotonic() < self._trust_until

    def ensure(self) -> None:
        """Raise ``LeaseLost`` unless the lease is valid; call before an unfenced side effect."""
        if not self.valid:
            raise LeaseLost(f"lease {self.name!r} is not held: {self._lost or 'trust window closed'}")

    def _trust(self, sent_at: float) -> None:
        self._trust_until = sent_at + self.ttl - trust_margin(self.ttl)

    async def acquire(self, wait: bool = True, timeout: float | None = None) -> int:  # noqa: ASYNC109 - the contract's signature
        """Take the lease (a new fence) and start renewing it; returns the fence."""
        if self.fence is not None:
            raise RuntimeError(f"lease {self.name!r} is already held by this Lease")
        if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            sent = time.monotonic()
            row = await run_statement(self._source, query("lease_acquire"),
                             (self.name, self.holder, self._ttl_ms, None))
            if row is not None:
                self.fence, self._lost = int(row[0]), None
                self._trust(sent)
                self._last_renewed = sent
                self._next_renewal = sent + self.ttl / 3
                self._renewer = asyncio.create_task(self._renew_loop(), name=f"pgcoord-lease:{self.name}")
                return self.fence
            if not wait:
                metrics.busy(self.name)
                raise LockBusy(f"lease {self.name!r} is held by another holder")
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise LockTimeout(f"lease {self.name!r} not acquired within {timeout}s")
            # No doorbell for a plain lease: look again after a third of a ttl.
            pause = self.ttl / 3
            await asyncio.sleep(pause if deadline is None else min(pause, deadline - now))

    async def _renew_loop(self) -> None:
        while self.fence is not None:
            await asyncio.sleep(max(0.0, self._next_renewal - time.monotonic()))
            sent = time.monotonic()
            attempt = asyncio.ensure_future(run_statement(
                self._source, query("lease_renew"), (self.name, self.holder, self.fence, self._ttl_ms)
            ))
            done, _ = await asyncio.wait({attempt}, timeout=max(0.0, self._trust_until - sent))
            if not done:
                attempt.cancel()
                attempt.add_done_callback(consume_result)
                self._lose("no renewal succeeded before the trust window closed")
                return
            error = attempt.exception()
            if error is None:
                if attempt.result() is None:
                    self._lose("the lease expired or was taken over")
                    return
                metrics.renewal(self.name, time.monotonic() - sent, sent - self._last_renewed)
                self._last_renewed = sent
                self._next_renewal = sent + self.ttl / 3
                self._trust(sent)
                continue
            # A transient error is not a loss while the trust window is open.
            log.warning("renewing lease %r failed, retrying: %r", self.name, error)
            if time.monotonic() >= self._trust_until:
                self._lose(f"renewal failed until the trust window closed: {error!r}")
                return
            self._next_renewal = time.monotonic() + min(
                self.ttl / 10, max(0.0, self._trust_until - time.monotonic())
            )

    def _lose(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = reason
        metrics.lock_lost(self.name, reason)
        log.warning("lease %r (fence %s) lost: %s", self.name, self.fence, reason)
        if self._body is not None:
            self._body.cancel(f"pgcoord: lease {self.name!r} lost: {reason}")

    async def release(self) -> None:
        """Stop renewing and give the lease up (a no-op if it was lost)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await renewer
        fence, self.fence = self.fence, None
        if fence is None:
            return

        async def give_up() -> None:
            try:
                async with asyncio.timeout(CLEANUP_TIMEOUT):
                    await run_statement(self._source, query("lease_release"), (self.name, self.holder, fence))
            except Exception as exc:  # it expires on its own; never mask the caller's error
                log.warning("releasing lease %r failed (it will expire): %r", self.name, exc)

        await finish_despite_cancel(give_up())

    async def __aenter__(self) -> int:
        fence = await self.acquire()
        self._body = asyncio.current_task()
        return fence

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._body = None
        lost = self._lost
        await self.release()
        if lost is not None:
            if isinstance(exc, asyncio.CancelledError):
                absorb_cancel()
            raise LeaseLost(f"lease {self.name!r} lost: {lost}") from exc



def _stale(exc: BaseException, name: str, fence: int) -> BaseException:
    code = _errmap.sqlstate(exc)
    if code == SQLSTATE_STALE_FENCE:
        metrics.fence_rejected(name, fence)
        message = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        return StaleFence(message)
    return _errmap.as_schema_missing(exc)


def check_fence(conn: Any, name: str, fence: int) -> Any:
    """Raise ``StaleFence`` unless ``fence`` is current for lease ``name``.

    Locks the lease row ``FOR SHARE`` in ``conn``'s transaction, so a takeover
    waits until that transaction ends: run it first in the transaction that
    does the fenced write. Returns an awaitable for async connections (asyncpg,
    psycopg ``AsyncConnection``, SQLAlchemy ``AsyncConnection``) and runs at
    once for sync ones (psycopg ``Connection``, SQLAlchemy ``Connection``).
    """
    validate_name(name)
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError("fence must be an int")
    sql, params = query("lease_check_fence"), (name, fence)
    if is_async_connection(conn):
        async def check() -> None:
            try:
                await fetchval_on(conn, sql, params)
            except Exception as exc:
                raise _stale(exc, name, fence) from exc
        return check()
    try:
        fetchval_on_sync(conn, sql, params)
    except Exception as exc:
        raise _stale(exc, name, fence) from exc
    return None
