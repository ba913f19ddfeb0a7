"""The portal: one event loop on a thread of its own, where the sync twins run
pgcoord's one (async) implementation.

A sync caller's statement is a coroutine submitted to that loop; the caller's thread
waits for its result. Background work (renewals, heartbeats, death news) runs on the
loop while the caller's code runs on its own thread, as it would next to any other
client library's I/O thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Portal", "in_thread", "portal"]

T = TypeVar("T")


class Portal:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="pgcoord-portal",
                                        daemon=True)
        self._thread.start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(ready.set)
        self.loop.run_forever()

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop; its result as a thread-safe future."""
        if self.on_loop():
            coro.close()
            raise RuntimeError("a pgcoord.sync object was called from pgcoord's own event loop "
                               "(from async code): use pgcoord's async classes there")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it. An interrupt (Ctrl-C) of the waiting
        thread cancels it there, and waits for it to wind down."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                future.cancel()
                concurrent.futures.wait([future])
            raise

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


_portal: Portal | None = None
_portal_lock = threading.Lock()


def portal() -> Portal:
    """The process's portal, started on first use."""
    global _portal
    with _portal_lock:
        if _portal is None:
            _portal = Portal()
            atexit.register(_portal.close)
        return _portal


def in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run the blocking ``fn(*args)`` on a new thread of its own (never the loop's pool:
    leads and jobs may run for hours); its result as an asyncio future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # delivered to the awaiting side
            future.set_exception(exc)

    threading.Thread(target=work, name=f"pgcoord-sync:{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return asyncio.wrap_future(future)
