"""The sync twins: each wraps one instance of the async class, running on the portal.

Methods that are coroutines in the async class are the same methods here, blocking;
properties read the async instance's state (plain values, safe to read from another
thread). What differs is only where user code runs: a sync ``lead``, a sync job and a
``with`` block run on threads of the caller's, and are told rather than cancelled.
"""

from __future__ import annotations

import functools
import inspect
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from ._bridge import Held, Term, async_source, blocking, open_async_source
from ._portal import Portal, portal

__all__ = ["Changes", "Elector", "Lease", "LockHolder", "Member", "Scheduler"]


class _Twin:
    """Coroutine methods of the wrapped object become blocking ones; the rest pass through."""

    _async: Any
    _portal: Portal

    # Parts of the async API that hand out loop-bound objects or run callbacks on the
    # portal's loop: not for sync code.
    _NOT_SYNC = frozenset({"session", "listen", "on_member_left", "on_session_lost", "stand"})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._NOT_SYNC:
            raise AttributeError(f"{name}() of the async class has no sync form in pgcoord.sync")
        attr = getattr(self._async, name)
        if inspect.iscoroutinefunction(attr):
            @functools.wraps(attr)
            def blocking_call(*args: Any, **kwargs: Any) -> Any:
                return self._portal.call(attr(*args, **kwargs))
            return blocking_call
        return attr


async def _awaited(fn: Callable[[], Awaitable[None]]) -> None:
    await fn()


def _on_portal(p: Portal, make: Callable[[], Any]) -> Any:
    """Build the async object on the loop (asyncio objects belong to the loop that uses them)."""
    async def build() -> Any:
        return make()
    return p.call(build())


class Changes:
    """A sync iterator over an async subscription (``watch()``), subscribed at once.
    With ``timeout``, iteration ends after that many seconds without a change. Close
    it (or use it as a context manager) when done: until then the subscription keeps
    collecting changes."""

    _END = object()

    def __init__(self, portal: Portal, subscribe: Callable[[], Any], timeout: float | None) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._timeout = timeout
        self._portal = portal
        subscription = _on_portal(portal, subscribe)
        changes = self._queue

        async def pump() -> None:
            try:
                async for change in subscription:
                    changes.put(change)
            except BaseException as exc:
                changes.put(exc)
                raise
            finally:
                subscription.close()
                changes.put(Changes._END)

        self._future = portal.submit(pump())

    def __iter__(self) -> Changes:
        return self

    def __next__(self) -> Any:
        try:
            item = self._queue.get(timeout=self._timeout)
        except queue.Empty:
            raise StopIteration from None
        if item is Changes._END:
            self._queue.put(item)  # every later call ends too
            raise StopIteration
        if isinstance(item, BaseException):
            if isinstance(item, Exception):
                raise item
            raise StopIteration  # cancelled: the portal is closing
        return item

    def close(self) -> None:
        self._future.cancel()

    def __enter__(self) -> Changes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        future = getattr(self, "_future", None)
        if future is not None:
            future.cancel()


class Member(_Twin):
    """``pgcoord.Member`` for sync code: ``with pgcoord.sync.Member(dsn) as member:``.
    ``watch()`` is an iterator that blocks for the next change."""

    def __init__(self, dsn: str, **options: Any) -> None:
        from ..member import Member as AsyncMember

        self._portal = portal()
        self._async = _on_portal(self._portal, lambda: AsyncMember(dsn, **options))

    def __enter__(self) -> Member:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def watch(self, timeout: float | None = None) -> Changes:
        """Membership changes from this call on (subscribed at once, as the async
        ``watch()``); see ``Changes``."""
        return Changes(self._portal, self._async.watch, timeout)


class LockHolder(_Twin):
    """``pgcoord.LockHolder`` for sync code: ``with holder.lock(key) as held:``. If the
    session dies while the block runs, ``held.lost`` turns true at once and leaving the
    block raises ``LockLost``; a long block should look at ``held.lost`` now and then."""

    def __init__(self, source: str | Member, **options: Any) -> None:
        from ..holder.holder import LockHolder as AsyncHolder

        self._portal = portal()
        inner = source._async if isinstance(source, Member) else source
        if not isinstance(inner, str) and not isinstance(source, Member):
            raise TypeError("pgcoord.sync.LockHolder takes a DSN or a pgcoord.sync.Member")
        self._async = _on_portal(self._portal, lambda: AsyncHolder(inner, **options))

    def __enter__(self) -> LockHolder:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock(self, key: int | str, *, wait: bool = True, timeout: float | None = None,
             shared: bool = False) -> Held[Any]:
        return Held(self._portal, lambda: self._async.lock(key, wait=wait, timeout=timeout, shared=shared),
                    yield_self=True)

    def semaphore(self, name: str, *, limit: int, wait: bool = True,
                  timeout: float | None = None) -> Held[Any]:
        return Held(self._portal,
                    lambda: self._async.semaphore(name, limit=limit, wait=wait, timeout=timeout),
                    yield_self=True)


class _Pooled(_Twin):
    """A twin whose async class takes a pool: it opens an async one of its own."""

    _close_pool: Callable[[], Awaitable[None]] | None

    def _open_pool(self, source: Any) -> Any:
        spec, _ = async_source(source)
        self._pool, self._close_pool = self._portal.call(open_async_source(spec))
        return self._pool

    def close_pool(self) -> None:
        close, self._close_pool = getattr(self, "_close_pool", None), None
        if close is not None:
            self._portal.call(_awaited(close))


class Lease(_Pooled):
    """``pgcoord.Lease`` for sync code: ``with lease as fence:``; ``lease.lost`` (or
    ``lease.valid``) during the block, ``LeaseLost`` when leaving it after a loss.
    ``source``: a DSN, a psycopg ``ConnectionPool`` or a SQLAlchemy ``Engine`` (an async
    pool on the same database is opened for it; ``close()`` closes that pool)."""

    def __init__(self, source: Any, name: str, *, ttl: float, member: Member | None = None,
                 **options: Any) -> None:
        from ..leases.lease import Lease as AsyncLease

        self._portal = portal()
        pool = self._open_pool(source)
        inner_member = None if member is None else member._async
        try:
            self._async = _on_portal(
                self._portal, lambda: AsyncLease(pool, name, ttl=ttl, member=inner_member, **options))
        except BaseException:
            self.close_pool()
            raise
        self._held: Held[int] | None = None

    @property
    def lost(self) -> bool:
        """True once the lease held by the current (or last) block was lost."""
        return self._held is not None and self._held.lost

    def __enter__(self) -> int:
        # One block at a time per Lease object (as for the async Lease).
        held = Held[int](self._portal, lambda: self._async)
        fence = int(held.__enter__())
        self._held = held
        return fence

    def __exit__(self, *exc: Any) -> None:
        held = self._held
        assert held is not None
        held.__exit__(*exc)

    def close(self) -> None:
        self.close_pool()


class Elector(_Twin):
    """``pgcoord.Elector`` for sync code. ``run(lead)`` blocks; ``lead(term)`` runs on a
    thread of its own while this replica leads, with ``term.fence`` and ``term.lost``
    (set the moment leadership is lost: ``lead`` must then return soon, since nothing
    can cancel a thread; the next term waits for it). ``stop()`` from another thread."""

    def __init__(self, source: str | Member, name: str, **options: Any) -> None:
        from ..elector.elector import Elector as AsyncElector

        self._portal = portal()
        inner = source._async if isinstance(source, Member) else source
        self._async = _on_portal(self._portal, lambda: AsyncElector(inner, name, **options))

    def watch(self, timeout: float | None = None) -> Changes:
        """Each change of leader from now on (``LeaderChanged``), while ``run()`` runs."""
        return Changes(self._portal, self._async.watch, timeout)

    def run(self, lead: Callable[[Term], object]) -> None:
        async def lead_async(fence: int) -> None:
            term = Term(fence)
            await blocking(lead, term, on_cancel=term.lost.set)

        self._portal.call(self._async.run(lead_async))


class Scheduler(_Pooled):
    """``pgcoord.Scheduler`` for sync code: jobs are plain functions run on threads of
    their own; ``run()`` blocks, ``stop()`` from another thread. ``source`` as for
    ``Lease``. A job cannot be cancelled: when its run must stop (the claim's trust
    window closes, a timeout), ``slot_lost(slot)`` turns true and the job should return."""

    def __init__(self, source: Any, *, member: Member | None = None, **options: Any) -> None:
        from ..scheduler import Scheduler as AsyncScheduler

        self._portal = portal()
        pool = self._open_pool(source)
        inner_member = None if member is None else member._async
        try:
            self._async = _on_portal(
                self._portal, lambda: AsyncScheduler(pool, member=inner_member, **options))
        except BaseException:
            self.close_pool()
            raise
        self._stops: dict[tuple[str, Any, int], threading.Event] = {}

    def _wrap(self, fn: Callable[[Any], object]) -> Callable[[Any], Any]:
        if inspect.iscoroutinefunction(fn):
            raise TypeError("pgcoord.sync.Scheduler runs plain functions; "
                            "use pgcoord.Scheduler for async ones")

        async def job(slot: Any) -> None:
            key = (slot.job, slot.at, slot.attempt)
            stop = self._stops.setdefault(key, threading.Event())
            try:
                await blocking(fn, slot, on_cancel=stop.set)
            finally:
                self._stops.pop(key, None)

        functools.update_wrapper(job, fn)
        return job

    def slot_lost(self, slot: Any) -> bool:
        stop = self._stops.get((slot.job, slot.at, slot.attempt))
        return stop is not None and stop.is_set()

    def cron(self, *args: Any, **kwargs: Any) -> Callable[[Callable[[Any], object]], Callable[[Any], object]]:
        if kwargs.get("transactional"):
            raise ValueError("a sync job cannot be transactional (its connection would be an async one); "
                             "open a transaction of your own in the job")
        register = self._async.cron(*args, **kwargs)

        def decorate(fn: Callable[[Any], object]) -> Callable[[Any], object]:
            register(self._wrap(fn))
            return fn
        return decorate

    def job(self, *args: Any, **kwargs: Any) -> Callable[[Callable[[Any], object]], Callable[[Any], object]]:
        if kwargs.get("transactional"):
            raise ValueError("a sync job cannot be transactional")
        register = self._async.job(*args, **kwargs)

        def decorate(fn: Callable[[Any], object]) -> Callable[[Any], object]:
            register(self._wrap(fn))
            return fn
        return decorate

    def close(self) -> None:
        self.close_pool()
