"""How sync code meets the async implementation: held contexts, blocking callbacks,
and connection sources."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from .._drivers.adapt import find_adapter
from .._drivers.dsn import open_pool
from ..errors import LockLost, UnsupportedConnection
from ._portal import Portal, in_thread

__all__ = ["Held", "Term", "async_source", "blocking"]

T = TypeVar("T")


class Held(Generic[T]):
    """A pgcoord async context (a session lock, a semaphore slot, a lease) held for a
    ``with`` block on the caller's thread.

    The async context lives in a task on the portal that waits for the block to end.
    When the lock is lost while the block runs, the async side cancels that task (the
    body, as far as it can tell): ``lost`` becomes true at once — a long block should
    look at it, or at ``lost_event`` — and leaving the block raises ``LockLost`` (or
    ``LeaseLost``), unless the block raised something of its own."""

    def __init__(self, portal: Portal, make: Callable[[], Any], *, yield_self: bool = False) -> None:
        self._portal = portal
        self._make = make
        self._yield_self = yield_self
        self.lost_event = threading.Event()
        self._release: asyncio.Event | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self.value: T | None = None

    @property
    def lost(self) -> bool:
        return self.lost_event.is_set()

    async def _hold(self, entered: concurrent.futures.Future[T]) -> None:
        release = self._release = asyncio.Event()
        try:
            async with self._make() as value:
                entered.set_result(value)
                await release.wait()
        except BaseException as exc:
            if not entered.done():
                entered.set_exception(exc)
            elif not release.is_set():
                self.lost_event.set()  # lost while the block ran
            raise

    def __enter__(self) -> Any:
        if self._future is not None:
            raise RuntimeError("this lock is already held; ask for it again")
        entered: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._future = self._portal.submit(self._hold(entered))
        try:
            self.value = entered.result()
        except BaseException:
            if not self._future.done():  # interrupted while waiting: stop asking
                self._future.cancel()
                concurrent.futures.wait([self._future])
            self._future = None
            raise
        return self if self._yield_self else self.value

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        future, self._future = self._future, None
        assert future is not None
        release = self._release
        if release is not None:
            self._portal.soon(release.set)
        try:
            future.result()
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            pass
        except LockLost:
            if exc is None:
                raise
        finally:
            self._release = None


class Term:
    """What a sync ``lead(term)`` gets: the term's ``fence``, and ``lost`` (an event)
    set the moment leadership is lost. A sync lead cannot be cancelled: it must return
    soon after ``lost`` is set; ``check()`` raises ``LeaseLost`` once it is."""

    def __init__(self, fence: int) -> None:
        self.fence = fence
        self.lost = threading.Event()

    def check(self) -> None:
        if self.lost.is_set():
            from ..errors import LeaseLost

            raise LeaseLost(f"leadership with fence {self.fence} was lost")

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True (at once) if leadership is lost meanwhile."""
        return self.lost.wait(seconds)


async def blocking(fn: Callable[..., T], *args: Any, on_cancel: Callable[[], object] | None = None) -> T:
    """``fn(*args)`` on a thread of its own. A thread cannot be cancelled: when this is
    cancelled, ``on_cancel`` tells ``fn`` to stop, and the cancellation goes on only once
    ``fn`` has returned (so that a lock or lease is never given up under running code)."""
    future = in_thread(fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel()
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue
            except BaseException:
                break
        raise


def async_source(source: Any) -> tuple[Any, Callable[[], Awaitable[None]] | None]:
    """The async source the implementation uses for a sync twin's ``source``: a DSN
    (an asyncpg pool, else a psycopg async pool), a psycopg ``ConnectionPool`` (an async
    pool on the same conninfo and sizes), or a SQLAlchemy ``Engine`` over psycopg or
    asyncpg (an async engine on the same URL). Returns it and how to close it; the
    twin opens it on the portal."""
    if isinstance(source, str):
        return ("dsn", source), None
    adapter = find_adapter(source)
    wanted = {"psycopg": "psycopg ConnectionPool", "sqlalchemy": "SQLAlchemy Engine"}
    if adapter is not None and adapter.driver in wanted:
        if adapter.is_async or not adapter.is_pool:
            raise TypeError(f"a sync twin takes a {wanted[adapter.driver]}, not {type(source).__name__}")
        if adapter.driver == "psycopg":
            return ("psycopg", source), None
        driver = source.url.get_driver_name()
        if driver not in ("psycopg", "asyncpg"):
            raise UnsupportedConnection(
                f"a sync twin runs pgcoord's async implementation: a SQLAlchemy engine over "
                f"{driver!r} has no async form; use postgresql+psycopg://")
        return ("sqlalchemy", source), None
    raise TypeError(f"a sync twin takes a DSN, a psycopg ConnectionPool or a SQLAlchemy Engine, "
                    f"not {type(source).__name__}")


async def open_async_source(spec: tuple[str, Any]) -> tuple[Any, Callable[[], Awaitable[None]]]:
    """On the portal: open the async source ``async_source`` described."""
    kind, source = spec
    if kind == "dsn":
        # The one DSN rule (asyncpg for a URL when installed, else psycopg), with a
        # connect timeout for each host of a multi-host DSN.
        return await open_pool(source, min_size=1, max_size=4)
    if kind == "psycopg":
        from psycopg_pool import AsyncConnectionPool

        ppool = AsyncConnectionPool(source.conninfo, kwargs=dict(source.kwargs or {}),
                                    min_size=max(1, source.min_size), max_size=max(2, source.max_size),
                                    open=False)
        await ppool.open()
        return ppool, ppool.close
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(source.url)
    return engine, engine.dispose
