"""OpenTelemetry: spans for lock waits and leadership terms, metrics mirrored as OTel
instruments, recorded by the SDK's in-memory exporter and reader."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import pgcoord

from .conftest import unique

_EXPORTER = InMemorySpanExporter()
_READER = InMemoryMetricReader()


@pytest.fixture(scope="module")
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    # The global providers can be set once per process; pgcoord's tracer and meter
    # (proxies until then) follow them from this moment.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    yield _EXPORTER, _READER
    # Later tests need not pay for exporting every lock wait.
    provider.shutdown()
    _EXPORTER.clear()


def points(reader: InMemoryMetricReader, metric: str) -> list[Any]:
    data = reader.get_metrics_data()
    found = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == metric:
                    found += list(m.data.data_points)
    return found


async def test_a_lock_wait_is_a_span_with_its_real_duration(
    dsn: str, otel: Any, room_for_lock_labels: None,
) -> None:
    exporter, reader = otel
    name = unique("otel-lock")
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=2)

    async def wait_for_it() -> None:
        async with pgcoord.exclusive(pool, name):
            pass

    try:
        async with pgcoord.exclusive(pool, name):
            waiter = asyncio.create_task(wait_for_it())
            await asyncio.sleep(0.3)
        await asyncio.wait_for(waiter, 5)
    finally:
        await pool.close()
    spans = [s for s in exporter.get_finished_spans()
             if s.name == "pgcoord.lock.wait" and s.attributes["pgcoord.name"] == name]
    assert len(spans) == 2
    longest = max(spans, key=lambda s: s.end_time - s.start_time)
    assert 0.2 < (longest.end_time - longest.start_time) / 1e9 < 5
    waits = [p for p in points(reader, "pgcoord.lock.wait") if p.attributes["pgcoord.name"] == name]
    assert waits and waits[0].count == 2


async def test_a_leadership_term_is_a_span_and_lost_locks_are_counted(
    dsn: str, otel: Any, room_for_lock_labels: None,
) -> None:
    exporter, reader = otel
    name = unique("otel-duty")
    elector = pgcoord.Elector(dsn, name, ttl=1.0)
    leading = asyncio.Event()

    async def lead(fence: int) -> None:
        leading.set()
        await asyncio.Event().wait()

    runner = asyncio.create_task(elector.run(lead))
    await asyncio.wait_for(leading.wait(), 5)
    fence = elector.fence
    assert not [s for s in exporter.get_finished_spans() if s.name == "pgcoord.leadership"
                and s.attributes["pgcoord.name"] == name]  # still open while it leads
    gauges = [p for p in points(reader, "pgcoord.leader") if p.attributes["pgcoord.name"] == name]
    assert [p.value for p in gauges] == [1]
    await elector.stop()
    with contextlib.suppress(asyncio.CancelledError):
        await runner
    terms = [s for s in exporter.get_finished_spans()
             if s.name == "pgcoord.leadership" and s.attributes["pgcoord.name"] == name]
    assert len(terms) == 1 and terms[0].attributes["pgcoord.fence"] == fence
    # A session lock lost while held is counted.
    async with pgcoord.LockHolder(dsn) as holder:
        lost_name = unique("otel-lost")
        with pytest.raises(pgcoord.LockLost):
            async with holder.lock(lost_name):
                conn = await asyncpg.connect(dsn)
                await conn.execute("select pg_terminate_backend($1)", holder.backend_pid)
                await conn.close()
                await asyncio.sleep(5)
    lost = [p for p in points(reader, "pgcoord.locks.lost") if p.attributes["pgcoord.name"] == lost_name]
    assert lost and lost[0].value == 1
    spans = [sp for sp in exporter.get_finished_spans()
             if sp.name == "pgcoord.lost" and sp.attributes["pgcoord.name"] == lost_name]
    assert len(spans) == 1 and spans[0].status.status_code.name == "ERROR"


async def test_a_slot_run_is_a_span_with_its_outcome(dsn: str, otel: Any) -> None:
    exporter, reader = otel
    ok, broken, handler = unique("otel-ok"), unique("otel-broken"), unique("otel-h")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=3)
    try:
        sched = pgcoord.Scheduler(pool)

        @sched.job(handler)
        async def work(slot: pgcoord.Slot) -> None:
            if slot.args.get("fail"):
                raise RuntimeError("broken")

        await sched.add(ok, "0 0 1 1 *", handler=handler)
        await sched.add(broken, "0 0 1 1 *", handler=handler, args={"fail": True})
        good = await sched.trigger(ok)
        bad = await sched.trigger(broken)
    finally:
        await pool.close()
    runs = {s.attributes["pgcoord.job"]: s for s in exporter.get_finished_spans()
            if s.name == "pgcoord.slot.run" and s.attributes["pgcoord.job"] in (ok, broken)}
    assert runs[ok].attributes["pgcoord.outcome"] == "succeeded"
    assert runs[ok].attributes["pgcoord.slot"] == good.at.isoformat()
    assert runs[ok].attributes["pgcoord.attempt"] == 1
    assert runs[broken].attributes["pgcoord.outcome"] == "failed"
    assert runs[broken].attributes["pgcoord.slot"] == bad.at.isoformat()
    assert not runs[broken].status.is_ok
    durations = [p for p in points(reader, "pgcoord.slot.run")
                 if p.attributes["pgcoord.handler"] == handler]
    assert sorted(p.attributes["pgcoord.outcome"] for p in durations) == ["failed", "succeeded"]
