"""Code that takes its first cancellation for a database error, as a driver can make it.

psycopg 3.2's ``AsyncConnection.wait()``, cancelled during a statement, sends a cancel
request and waits for the statement again; when the connection breaks meanwhile (as
every one does when the server goes) the ``OperationalError`` of that wait replaces the
``CancelledError``. Code that retries on database errors then carries on as if nothing
had been asked of it. ``Converting`` plays that part deterministically: the first
cancellation arrives as ``OperationalError``, later ones as themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg

CONVERTED = "server closed the connection unexpectedly"


async def statement_in_flight(converted: bool) -> None:
    """A long statement; its cancellation comes back as OperationalError unless
    ``converted`` says that has happened once already."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if converted:
            raise
        raise psycopg.OperationalError(CONVERTED) from None


class Converting:
    """A body (``lead(fence)``, ``own(part)``, a job) that retries its statement on
    database errors, or raises the error when ``retries`` is False; it records each
    start (with its argument), how many errors it took, and when it ended.
    ``on_end`` runs as it ends (in its ``finally``)."""

    def __init__(self, *, retries: bool = True, on_end: Callable[[], None] | None = None) -> None:
        self.retries = retries
        self.on_end = on_end
        self.starts: list[object] = []
        self.errors = 0
        self.ended: list[float] = []

    async def __call__(self, arg: object = None) -> None:
        self.starts.append(arg)
        try:
            while True:
                try:
                    await statement_in_flight(converted=self.errors > 0)
                except psycopg.OperationalError:
                    self.errors += 1
                    if not self.retries:
                        raise
                    await asyncio.sleep(0.02)  # and try the statement again
        finally:
            self.ended.append(time.monotonic())
            if self.on_end is not None:
                self.on_end()


async def cancelling_after_loss(block: AbstractAsyncContextManager[Any], entered: asyncio.Event,
                                lost: type[BaseException]) -> int:
    """Inside ``block`` (a held lock, a lease), a statement whose cancellation comes back
    as an error; once ``block`` raises ``lost``, the task's ``cancelling()`` count."""
    try:
        async with block:
            entered.set()
            await statement_in_flight(converted=False)
    except lost:
        current = asyncio.current_task()
        assert current is not None
        return current.cancelling()
    raise AssertionError(f"the block ended without {lost.__name__}")
