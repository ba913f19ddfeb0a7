"""``/events``: the live stream an open page follows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .dashboard import dashboard_of
from .sample import Sample

#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE = 15.0


class EventStream:
    """``/events``: server-sent events carrying the sample's version, sent again
    whenever it changes, and a comment every KEEPALIVE seconds otherwise.

    A bare ASGI endpoint rather than a streaming response, so that a page that goes
    away (its ``http.disconnect``) ends the stream at once, and with it the page's
    share of the sampler, whichever version of ASGI the server speaks."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        dash = dashboard_of(Request(scope, receive))
        sampler, closing = dash.sampler, dash.closing()
        gone = asyncio.Event()

        async def watch() -> None:
            # The page leaves (http.disconnect), or the server goes down (closing).
            leaving = asyncio.ensure_future(_disconnected(receive))
            down = asyncio.ensure_future(closing.wait())
            try:
                await asyncio.wait({leaving, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (leaving, down):
                    task.cancel()
                await asyncio.gather(leaving, down, return_exceptions=True)
            gone.set()

        async with sampler.listening() as next_change:
            watcher = asyncio.get_running_loop().create_task(watch(), name="pgcoord.web page gone?")
            try:
                sample = await sampler.current()
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]})
                await self._send(send, f"retry: 1000\nevent: version\ndata: {sample.version}\n\n")
                while True:
                    new = await _until_gone(next_change(sample.version, KEEPALIVE), gone)
                    if new is None:
                        if closing.is_set():  # end the response whole; the page reconnects
                            await send({"type": "http.response.body", "body": b"", "more_body": False})
                        return
                    if new.version == sample.version:
                        await self._send(send, ": still here\n\n")
                    else:
                        await self._send(send, f"event: version\ndata: {new.version}\n\n")
                    sample = new
            except OSError:  # the page went away mid-send (ASGI 2.4 servers tell it so)
                return
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    @staticmethod
    async def _send(send: Send, text: str) -> None:
        await send({"type": "http.response.body", "body": text.encode(), "more_body": True})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_gone(waiting: Awaitable[Sample], gone: asyncio.Event) -> Sample | None:
    """``waiting``'s sample, or None once the page is gone (``waiting`` is cancelled)."""
    task = asyncio.ensure_future(waiting)
    stop = asyncio.get_running_loop().create_task(gone.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    return None if gone.is_set() or task.cancelled() else task.result()
