"""OpenTelemetry: spans for lock waits, leadership terms and slot runs, and pgcoord's
metrics mirrored as OTel instruments (the ``otel`` extra: ``opentelemetry-api``).

pgcoord uses the global tracer and meter providers, as a library should: nothing is
exported until the application configures an SDK, and then everything goes where
the application sends its own telemetry. Without ``opentelemetry-api`` installed
this module does nothing at all.

A lock wait is known only once it is over, so its span is recorded afterwards with
the wait's real start and end times. A leadership term is a span from the moment
a replica leads to the moment it stops; a slot run, from its start to its record.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

__all__ = ["sink"]

SCOPE = "pgcoord"

# The synchronous instruments (attribute, kind, name, description); counters count
# ("1"), histograms measure seconds.
_INSTRUMENTS = (
    ("leadership_changes", "counter", "pgcoord.leadership.changes",
     "Times this replica gained or lost leadership"),
    ("renewal_latency", "histogram", "pgcoord.lease.renewal", "Round trip of a successful lease renewal"),
    ("fence_rejections", "counter", "pgcoord.fence.rejections", "check_fence calls that raised StaleFence"),
    ("lock_wait_seconds", "histogram", "pgcoord.lock.wait", "Time from asking for a lock to holding it"),
    ("lock_busy", "counter", "pgcoord.lock.busy", "wait=False attempts that found the lock held"),
    ("locks_lost", "counter", "pgcoord.locks.lost", "Locks and leases lost while held"),
    ("slot_runs", "histogram", "pgcoord.slot.run", "Duration of a job slot's run, by outcome"),
)


class Sink:
    """The OTel side of ``pgcoord.metrics``: one method per signal."""

    leadership_changes: Any
    renewal_latency: Any
    fence_rejections: Any
    lock_wait_seconds: Any
    lock_busy: Any
    locks_lost: Any
    slot_runs: Any

    def __init__(self, trace: Any, metrics: Any) -> None:
        from .._core.version import __version__

        self._trace = trace
        self._tracer = trace.get_tracer(SCOPE, __version__)
        meter = metrics.get_meter(SCOPE, __version__)
        self._terms: dict[str, Any] = {}
        self._runs: dict[tuple[str, str], Any] = {}
        # Gauges are observed: OTel API 1.20 (the lowest we allow) has no
        # synchronous gauge, so the last value of each is kept here.
        self._gauges: dict[str, dict[tuple[tuple[str, Any], ...], float]] = {
            "pgcoord.leader": {}, "pgcoord.fence": {}, "pgcoord.lease.renewal_gap": {},
            "pgcoord.jobs.failing": {}, "pgcoord.partitions.owned": {},
        }
        units = {"pgcoord.lease.renewal_gap": "s"}
        for gauge, values in self._gauges.items():
            meter.create_observable_gauge(gauge, callbacks=[self._observer(metrics, values)],
                                          unit=units.get(gauge, "1"))
        for attr, kind, instrument, description in _INSTRUMENTS:
            create = meter.create_counter if kind == "counter" else meter.create_histogram
            setattr(self, attr, create(instrument, unit="s" if kind == "histogram" else "1",
                                       description=description))

    @staticmethod
    def _observer(metrics: Any, values: dict[tuple[tuple[str, Any], ...], float]) -> Any:
        def observe(_options: Any) -> list[Any]:
            return [metrics.Observation(value, dict(attrs)) for attrs, value in list(values.items())]
        return observe

    def _set(self, gauge: str, value: float, **attrs: Any) -> None:
        self._gauges[gauge][tuple(sorted(attrs.items()))] = value

    # -- signals ------------------------------------------------------------------------

    def leadership(self, name: str, is_leader: bool, fence: int | None) -> None:
        self.leadership_changes.add(1, {"pgcoord.name": name})
        self._set("pgcoord.leader", 1 if is_leader else 0, **{"pgcoord.name": name})
        self._set("pgcoord.fence", fence if is_leader and fence is not None else 0, **{"pgcoord.name": name})
        term = self._terms.pop(name, None)
        if term is not None:
            term.end()
        if is_leader:
            self._terms[name] = self._tracer.start_span(
                "pgcoord.leadership", attributes={"pgcoord.name": name, "pgcoord.fence": fence or 0})

    def campaigning(self, name: str) -> None:
        self._set("pgcoord.leader", 0, **{"pgcoord.name": name})
        self._set("pgcoord.fence", 0, **{"pgcoord.name": name})

    def renewal(self, name: str, latency: float, gap: float) -> None:
        self.renewal_latency.record(latency, {"pgcoord.name": name})
        self._set("pgcoord.lease.renewal_gap", gap, **{"pgcoord.name": name})

    def fence_rejected(self, name: str, fence: int) -> None:
        self.fence_rejections.add(1, {"pgcoord.name": name})

    # ``label`` is ``name`` for the first names a process uses, one shared label
    # past them (metrics.LOCK_NAMES_LABELLED): metric attributes must stay
    # bounded, while a span is one event and keeps the real name.
    def lock_wait(self, name: str, seconds: float, label: str) -> None:
        self.lock_wait_seconds.record(seconds, {"pgcoord.name": label})
        end = time.time_ns()
        span = self._tracer.start_span("pgcoord.lock.wait", start_time=end - int(seconds * 1e9),
                                       attributes={"pgcoord.name": name, "pgcoord.waited_s": seconds})
        span.end(end_time=end)

    def busy(self, label: str) -> None:
        self.lock_busy.add(1, {"pgcoord.name": label})

    def lock_lost(self, name: str, reason: str, label: str) -> None:
        self.locks_lost.add(1, {"pgcoord.name": label})
        # A leadership term has ended by now (the elector steps down first, then says
        # why): the loss is a span of its own, an error, right after the term's.
        span = self._tracer.start_span("pgcoord.lost", attributes={"pgcoord.name": name,
                                                                   "pgcoord.reason": reason})
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, reason))
        span.end()

    def jobs_failing(self, handler: str, count: int) -> None:
        self._set("pgcoord.jobs.failing", count, **{"pgcoord.handler": handler})

    def parts_owned(self, name: str, count: int) -> None:
        self._set("pgcoord.partitions.owned", count, **{"pgcoord.name": name})

    def slot_started(self, job: str, at: str, attempt: int, runner: str) -> None:
        self._runs[(job, at)] = self._tracer.start_span("pgcoord.slot.run", attributes={
            "pgcoord.job": job, "pgcoord.slot": at, "pgcoord.attempt": attempt, "pgcoord.runner": runner})

    def slot_finished(self, job: str, at: str, outcome: str, seconds: float, handler: str) -> None:
        self.slot_runs.record(seconds, {"pgcoord.handler": handler, "pgcoord.outcome": outcome})
        span = self._runs.pop((job, at), None)
        if span is not None:
            span.set_attribute("pgcoord.outcome", outcome)
            if outcome not in ("succeeded", "skipped"):
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, outcome))
            span.end()


@cache
def sink() -> Sink | None:
    """The OTel sink, or None when ``opentelemetry-api`` is not installed."""
    try:
        from opentelemetry import metrics, trace
    except ImportError:
        return None
    return Sink(trace, metrics)
