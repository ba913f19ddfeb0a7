"""finish_despite_cancel: cleanups finish, whether or not they suspend, and a
cancellation that arrives meanwhile is delivered afterwards."""

from __future__ import annotations

import asyncio

import pytest

from pgcoord._aio import finish_despite_cancel


async def test_a_cleanup_that_never_suspends_returns_its_value() -> None:
    async def cleanup() -> int:
        return 7

    tasks_before = len(asyncio.all_tasks())
    assert await finish_despite_cancel(cleanup()) == 7
    assert len(asyncio.all_tasks()) == tasks_before


async def test_a_failing_cleanup_raises_its_error() -> None:
    async def cleanup() -> None:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        await finish_despite_cancel(cleanup())


async def test_a_cleanup_that_suspends_finishes_though_its_caller_is_cancelled() -> None:
    steps: list[str] = []
    started = asyncio.Event()

    async def cleanup() -> None:
        steps.append("start")
        started.set()
        await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # a bare yield as well as a future
        steps.append("end")

    async def caller() -> None:
        await finish_despite_cancel(cleanup())

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["start", "end"]


async def test_a_future_failing_under_a_suspended_cleanup_reaches_the_cleanup() -> None:
    loop = asyncio.get_running_loop()
    doomed: asyncio.Future[None] = loop.create_future()
    loop.call_later(0.01, doomed.set_exception, ConnectionResetError("peer gone"))

    async def cleanup() -> str:
        try:
            await doomed
        except ConnectionResetError as exc:
            return f"handled {exc}"
        return "not reached"

    assert await finish_despite_cancel(cleanup()) == "handled peer gone"


async def test_a_cleanup_failing_after_it_suspended_raises_to_the_caller() -> None:
    async def cleanup() -> None:
        await asyncio.sleep(0.01)
        raise OSError("rollback failed")

    with pytest.raises(OSError, match="rollback failed"):
        await finish_despite_cancel(cleanup())
