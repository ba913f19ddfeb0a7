"""finish_despite_cancel: cleanups finish, whether or not they suspend, and a
cancellation that arrives meanwhile is delivered afterwards."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pgcoord._core.aio import CleanupTimeout, Supervisor, finish_despite_cancel


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


def test_the_inline_first_step_protocol_holds_on_this_interpreter() -> None:
    # finish_despite_cancel steps a cleanup by hand, relying on asyncio's private
    # _asyncio_future_blocking protocol. If an interpreter changes it, the helper
    # falls back to a task per cleanup; this test says so loudly.
    import sys

    from pgcoord._core import aio as _aio

    assert _aio.INLINE_FIRST_STEP is (sys.version_info < (3, 12))


async def test_a_cleanup_past_its_bound_is_abandoned_and_the_caller_goes_on() -> None:
    discarded: list[str] = []
    finally_ran = asyncio.Event()

    async def hung_cleanup() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            finally_ran.set()

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(CleanupTimeout):
        await finish_despite_cancel(hung_cleanup(), bound=0.2, on_timeout=lambda: discarded.append("x"))
    assert 0.15 < loop.time() - started < 2.0
    assert discarded == ["x"]
    # The caller's task carries no cancellation it did not ask for.
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0)  # the abandoned cleanup ran its finally in its own task
    await asyncio.wait_for(finally_ran.wait(), 1.0)


async def test_a_hung_cleanup_of_a_cancelled_caller_delivers_only_the_cancel() -> None:
    started = asyncio.Event()

    async def hung_cleanup() -> None:
        started.set()
        await asyncio.sleep(60)

    async def caller() -> None:
        await finish_despite_cancel(hung_cleanup(), bound=0.2)

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)


async def test_a_timeout_inside_the_caller_is_untouched_by_the_cleanup_bound() -> None:
    # The regression this guards: a cleanup's bound used to be an asyncio.timeout
    # entered on the caller's task, which then cancelled the caller.
    async def slow_cleanup() -> str:
        await asyncio.sleep(0.05)
        return "done"

    async with asyncio.timeout(5):
        assert await finish_despite_cancel(slow_cleanup(), bound=0.01 + 1.0) == "done"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_driver_wait_for_in_the_cleanup_never_cancels_the_caller() -> None:
    # psycopg 3.2 waits on its socket with asyncio.wait_for(..., 0.1) in a loop; from
    # Python 3.12 such a timeout binds to the task that enters it. The cleanup's
    # first step must therefore never run on the caller's task there.
    answer = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, answer.set)

    async def cleanup() -> str:
        while True:
            try:
                await asyncio.wait_for(answer.wait(), 0.1)
                return "answered"
            except TimeoutError:
                continue

    assert await finish_despite_cancel(cleanup(), bound=5) == "answered"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_supervisor_stop_delivers_its_caller_s_cancellation_though_its_tasks_end_cancelled() -> None:
    """The caller of stop() cancelled while it waits for a task that takes a moment to
    end its cancellation (a driver cancelling its statement): the tasks all end, and
    the caller is cancelled. Before, a task ending cancelled hid the caller's own
    cancellation: a Member's runner went on to join again, and close() waited for it
    for ever."""
    supervisor = Supervisor("test", logging.getLogger("test"))
    ended: list[str] = []

    async def slow_to_end(name: str) -> None:
        try:
            try:
                await asyncio.sleep(3600)
            finally:
                await finish_despite_cancel(asyncio.sleep(0.05))
        finally:
            ended.append(name)

    for name in ("a", "b"):
        supervisor.spawn(slow_to_end(name), name)
    await asyncio.sleep(0)
    stopping = asyncio.create_task(supervisor.stop())
    await asyncio.sleep(0.01)
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert sorted(ended) == ["a", "b"]
