"""Hostile tests of the process's shared membership-news hub (news_hub.py)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import pgcoord
from pgcoord._core.embedded import EmbeddedServer

from .test_member_news_hub import CHANNEL, Watcher, listening, terminate, until


class JoinWatcher(Watcher):
    """A Watcher that also records joins (ids)."""

    def __init__(self, member: pgcoord.Member) -> None:
        self.joined: set[int] = set()
        super().__init__(member)

    async def _collect(self) -> None:
        async for change in self._changes:
            if isinstance(change, pgcoord.MemberLeft):
                self.left[change.member.id] = change.reason
            elif isinstance(change, pgcoord.MemberJoined):
                self.joined.add(change.member.id)


def g() -> str:
    return f"hubx-{uuid.uuid4().hex[:6]}"


async def listeners(members: list[pgcoord.Member]) -> int:
    n = 0
    for m in members:
        with contextlib.suppress(Exception):
            n += CHANNEL in await listening(m)
    return n


async def test_all_members_lose_their_sessions_at_once_and_news_goes_on(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        ms = [await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0)) for _ in range(3)]
        ws = [JoinWatcher(m) for m in ms]
        try:
            await until(lambda: all(m._hears_news for m in ms), 5, "hear")
            ids = [m.id for m in ms]
            terminate(dsn, *[m._main.backend_pid for m in ms])  # type: ignore[union-attr]
            await until(lambda: all(m.has_session and m.id not in ids for m in ms), 15, "all rejoined")
            await asyncio.sleep(1.5)  # a heartbeat or so
            assert await listeners(ms) == 1, [await listening(m) for m in ms]
            hub = ms[0]._hub
            assert hub.carrier in ms and all(hub.has(m) for m in ms)
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(w.left.get(gone) == "crashed" for w in ws), 5, "told of the death")
            # And of a join.
            newcomer = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
            await until(lambda: all(newcomer.id in w.joined for w in ws), 5, "told of the join")
        finally:
            for w in ws:
                w.close()


async def test_the_carrier_closes_while_others_watch(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        ms = [await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0)) for _ in range(3)]
        ws = [JoinWatcher(m) for m in ms]
        try:
            await until(lambda: all(m._hears_news for m in ms), 5, "hear")
            hub = ms[0]._hub
            carrier = hub.carrier
            assert isinstance(carrier, pgcoord.Member)
            cw = next(w for w in ws if w.member is carrier)
            await carrier.close()
            rest = [w for w in ws if w is not cw]
            assert not hub.has(carrier) and hub.carrier is not carrier
            await until(lambda: any(CHANNEL in w.member._listening for w in rest), 5, "a new carrier")
            assert await listeners([w.member for w in rest]) == 1
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(w.left.get(gone) == "crashed" for w in rest), 5, "told")
            newcomer = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
            await until(lambda: all(newcomer.id in w.joined for w in rest), 5, "join told")
        finally:
            for w in ws:
                w.close()
    # Everyone closed: the hub keeps nobody.
    assert not hub._readers and hub.carrier is None


async def test_a_carrier_s_watch_closed_then_reopened(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        ms = [await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0)) for _ in range(2)]
        ws = [JoinWatcher(m) for m in ms]
        try:
            await until(lambda: all(m._hears_news for m in ms), 5, "hear")
            carrier = ms[0]._hub.carrier
            i = next(i for i, w in enumerate(ws) if w.member is carrier)
            ws[i].close()
            await until(lambda: CHANNEL not in carrier._listening, 5, "let go")  # type: ignore[union-attr]
            ws[i] = JoinWatcher(carrier)  # type: ignore[arg-type]
            await until(lambda: carrier._hears_news, 5, "hears again")  # type: ignore[union-attr]
            await asyncio.sleep(0.3)
            assert await listeners(ms) == 1
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(w.left.get(gone) == "crashed" for w in ws), 5, "told")
        finally:
            for w in ws:
                w.close()


async def test_reopening_a_watch_before_the_beat_lets_go(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        m = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        w = Watcher(m)
        await until(lambda: m._hears_news, 5, "hear")
        w.close()
        w = Watcher(m)
        await asyncio.sleep(2.5)  # beats pass
        try:
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: w.left.get(gone) == "crashed", 5, "told")
        finally:
            w.close()


async def test_mixed_drivers_share_the_hub(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        a = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0, driver="psycopg"))
        b = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        c = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0, driver="psycopg"))
        ws = [Watcher(m) for m in (a, b, c)]
        try:
            await until(lambda: all(w.member._hears_news for w in ws), 5, "hear")
            assert a._hub is b._hub is c._hub
            carrier = a._hub.carrier
            assert carrier in (a, b, c)
            others = [m for m in (a, b, c) if m is not carrier]
            terminate(dsn, carrier._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: any(CHANNEL in m._listening for m in others), 5, "handed over")
            await until(lambda: carrier.has_session, 10, "carrier back")  # type: ignore[union-attr]
            await asyncio.sleep(0.5)
            assert await listeners([a, b, c]) == 1
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(w.left.get(gone) == "crashed" for w in ws), 5, "told")
        finally:
            for w in ws:
                w.close()


async def test_a_carrier_with_another_channel_lets_both_go(dsn: str) -> None:
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        a = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        b = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        wa, wb = Watcher(a), Watcher(b)
        try:
            await until(lambda: a._hears_news and b._hears_news, 5, "hear")
            await until(lambda: a._hub.carrier in (a, b), 5, "one of them carries")
            if a._hub.carrier is b:
                a, b, wa, wb = b, a, wb, wa
            heard: list[str] = []
            stop = await a.listen("hubx_other", heard.append)
            stop_b = await b.listen("hubx_other2", heard.append)
            wa.close()
            await asyncio.sleep(2.0)
            assert a._hub.carrier is a  # still needs news (another channel)
            stop()
            await until(lambda: CHANNEL not in a._listening and CHANNEL in b._listening, 5, "handed over")
            await asyncio.sleep(0.3)
            assert await listening(a) == []
            assert sorted(await listening(b)) == sorted([CHANNEL, "hubx_other2"])
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: wb.left.get(gone) == "crashed", 5, "told")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("notify hubx_other2, 'x'")
            await until(lambda: heard == ["x"], 5, "other channel still heard")
            stop_b()
        finally:
            wa.close()
            wb.close()


def test_two_event_loops_each_have_a_carrier(dsn: str) -> None:
    group = g()
    ready = threading.Barrier(3)
    done = threading.Event()
    results: dict[int, Any] = {}

    def run(k: int) -> None:
        async def main() -> None:
            async with pgcoord.Member(dsn, group=group, ttl=3.0) as m, \
                       pgcoord.Member(dsn, group=group, ttl=3.0) as m2:
                ws = [Watcher(m), Watcher(m2)]
                await until(lambda: m._hears_news and m2._hears_news, 5, "hear")
                results[k] = (ws, await listeners([m, m2]))
                ready.wait(10)
                while not done.is_set():
                    await asyncio.sleep(0.05)
                for w in ws:
                    w.close()
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001
            results[-k - 1] = exc
            with contextlib.suppress(Exception):
                ready.abort()

    async def victim_side() -> None:
        async with pgcoord.Member(dsn, group=group, ttl=3.0) as victim:
            threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2)]
            for t in threads:
                t.start()
            await asyncio.to_thread(ready.wait, 20)
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(all(w.left.get(gone) == "crashed" for w in results[k][0])
                                    for k in (1, 2)), 5, "both loops told")
            done.set()
            for t in threads:
                await asyncio.to_thread(t.join, 20)

    try:
        asyncio.run(victim_side())
    finally:
        done.set()
    assert results[1][1] == 1 and results[2][1] == 1, results


@pytest.fixture(scope="module")
def own_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer({"synchronous_commit": "on"}) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server


async def test_news_goes_on_after_a_server_restart(own_server: EmbeddedServer) -> None:
    dsn = own_server.dsn
    group = g()
    async with contextlib.AsyncExitStack() as stack:
        victim = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=1.5))
        ms = [await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=1.5)) for _ in range(3)]
        ws = [JoinWatcher(m) for m in ms]
        try:
            await until(lambda: all(m._hears_news for m in ms), 5, "hear")
            await asyncio.to_thread(own_server.restart)
            await until(lambda: all(m.has_session for m in ms + [victim]), 20, "rejoined")
            await asyncio.sleep(1.0)
            assert await listeners(ms) == 1, [await listening(m) for m in ms]
            gone = victim.id
            terminate(dsn, victim._main.backend_pid)  # type: ignore[union-attr]
            await until(lambda: all(w.left.get(gone) == "crashed" for w in ws), 5, "told")
        finally:
            for w in ws:
                w.close()


async def test_a_lone_carrier_rejoining_hears_a_death_right_after_its_join(dsn: str) -> None:
    """The only member of the process that needs news loses its session and joins
    again. Before the hub a member that needed news LISTENed *before* joining, so
    nothing after its first read was missed. A LISTEN that takes a while (a slow
    round trip, modelled by a delay in front of it) must not open a window in which
    a peer's death is never told to the rejoined member's watch."""
    group = g()
    events: list[tuple[str, int]] = []
    async with contextlib.AsyncExitStack() as stack:
        # Ring by id after w's rejoin: p0, v, p1, p2, w -- v is not w's neighbour.
        p0 = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        v = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        w = await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0))
        ps = [await stack.enter_async_context(pgcoord.Member(dsn, group=group, ttl=3.0)) for _ in range(2)]
        changes = w.watch()

        async def collect() -> None:
            async for change in changes:
                kind = "left" if isinstance(change, pgcoord.MemberLeft) else "joined"
                events.append((kind, change.member.id))

        task = asyncio.create_task(collect())
        try:
            await until(lambda: w._hub.carrier is w and CHANNEL in w._listening, 5, "w carries")
            original_step = w._channels.step
            original_first = w._channels.listen_first

            async def slow_step(main: Any, base: Any, on_base: Any) -> Any:
                if base == CHANNEL and CHANNEL not in w._channels.listening:
                    await asyncio.sleep(1.5)
                return await original_step(main, base, on_base)

            async def slow_first(main: Any, channel: str, callback: Any) -> None:
                await asyncio.sleep(1.5)
                await original_first(main, channel, callback)

            w._channels.step = slow_step  # type: ignore[method-assign]
            w._channels.listen_first = slow_first  # type: ignore[method-assign]
            old_id, gone = w.id, v.id
            assert w._main is not None and v._main is not None
            terminate(dsn, w._main.backend_pid)
            await until(lambda: w.id not in (None, old_id) and gone in w._view, 10, "w rejoined and read")
            mark = len(events)
            terminate(dsn, v._main.backend_pid)
            await until(lambda: w.has_session, 10, "w has its session")
            await until(lambda: CHANNEL in w._listening, 5, "w listens again")
            await until(lambda: ("left", gone) in events[mark:], 5,
                        "the rejoined watcher is told of a death right after its join")
        finally:
            changes.close()
            task.cancel()
        del p0, ps
