"""The diagnostic signals of leases, electors and locks.

Every signal is a structured log record on the ``pgcoord.metrics`` logger
(fields in ``record.pgcoord``); when ``prometheus_client`` is installed, a
Prometheus metric in its default registry; and when ``opentelemetry-api`` is
installed, an OTel instrument and, for lock waits, leadership terms and slot
runs, a span (``pgcoord.observability.otel``), exported wherever the application's SDK sends
them. Labels are lease or lock *names*
only, never keys or holders, so cardinality stays bounded by your code.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from . import otel as _otel

log = logging.getLogger("pgcoord.metrics")

__all__ = [
    "busy",
    "campaigning",
    "fence_rejected",
    "job_failing",
    "job_recovered",
    "jobs_failing",
    "leadership",
    "lock_lost",
    "lock_wait",
    "parts_owned",
    "renewal",
    "slot_finished",
    "slot_started",
]


@cache
def _prometheus() -> dict[str, Any] | None:
    try:
        import prometheus_client as prom
    except ImportError:
        return None
    return {
        "is_leader": prom.Gauge("pgcoord_is_leader", "1 while this replica leads", ["name"]),
        "fence": prom.Gauge("pgcoord_fence", "Current fence held by this replica (0 when none)",
                            ["name"]),
        "changes": prom.Counter("pgcoord_leadership_changes", "Times this replica gained or "
                                "lost leadership", ["name"]),
        "renew_latency": prom.Histogram(
            "pgcoord_lease_renewal_seconds", "Round trip of a successful lease renewal", ["name"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)),
        "renew_gap": prom.Gauge("pgcoord_lease_renewal_gap_seconds",
                                "Time between the last two successful renewals", ["name"]),
        "fence_rejections": prom.Counter("pgcoord_fence_rejections",
                                         "check_fence calls that raised StaleFence", ["name"]),
        "lock_wait": prom.Histogram(
            "pgcoord_lock_wait_seconds", "Time from asking for a lock to holding it", ["name"],
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120)),
        "busy": prom.Counter("pgcoord_lock_busy", "wait=False attempts that found the lock held",
                             ["name"]),
        "lost": prom.Counter("pgcoord_locks_lost", "Locks and leases lost while held", ["name"]),
        # By handler, not by schedule: schedules added at run time (one per
        # tenant) would make the label set unbounded.
        "parts_owned": prom.Gauge("pgcoord_parts_owned", "Parts of a Partitions this replica "
                                  "owns", ["name"]),
        "jobs_failing": prom.Gauge("pgcoord_jobs_failing", "Schedules run by this replica with "
                                   "no success in their last K expected slots", ["handler"]),
    }


def warm_up() -> None:
    """Import prometheus_client now, off any failover path (the import takes ~20 ms)."""
    _prometheus()


# Labelled children, looked up once per (metric, name): prometheus_client's
# labels() takes a lock and builds a key on every call, on the lock hot path.
_children: dict[tuple[str, str], Any] = {}


def _child(metric: str, name: str) -> Any:
    child = _children.get((metric, name))
    if child is None:
        prom = _prometheus()
        assert prom is not None
        child = _children[(metric, name)] = prom[metric].labels(name)
    return child


def _emit(event: str, name: str, level: int = logging.DEBUG, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(level, "%s %s %s", event, name, fields,
                extra={"pgcoord": {"event": event, "name": name, **fields}})


def leadership(name: str, is_leader: bool, fence: int | None) -> None:
    _emit("leadership", name, logging.INFO, is_leader=is_leader, fence=fence)
    if (prom := _prometheus()) is not None:
        prom["is_leader"].labels(name).set(1 if is_leader else 0)
        prom["fence"].labels(name).set(fence if is_leader and fence is not None else 0)
        prom["changes"].labels(name).inc()
    if (otel := _otel.sink()) is not None:
        otel.leadership(name, is_leader, fence)


def campaigning(name: str) -> None:
    """An elector started: it exports ``is_leader`` 0 from now on, so that "nobody
    leads" shows as zeros rather than as no series at all."""
    if (prom := _prometheus()) is not None:
        prom["is_leader"].labels(name).set(0)
        prom["fence"].labels(name).set(0)
    if (otel := _otel.sink()) is not None:
        otel.campaigning(name)


def renewal(name: str, latency: float, gap: float) -> None:
    _emit("lease_renewed", name, latency=round(latency, 6), gap=round(gap, 6))
    if (prom := _prometheus()) is not None:
        prom["renew_latency"].labels(name).observe(latency)
        prom["renew_gap"].labels(name).set(gap)
    if (otel := _otel.sink()) is not None:
        otel.renewal(name, latency, gap)


def fence_rejected(name: str, fence: int) -> None:
    _emit("fence_rejected", name, logging.INFO, fence=fence)
    if (prom := _prometheus()) is not None:
        prom["fence_rejections"].labels(name).inc()
    if (otel := _otel.sink()) is not None:
        otel.fence_rejected(name, fence)


#: The most distinct lock names one process gives their own label in the lock
#: metrics (``lock_wait``, ``busy``, ``lock_lost``). An application that locks per
#: entity (``exclusive(pool, f"order:{id}")``) would otherwise make a series per
#: entity, for the life of the process, in every scrape. Names past the first
#: ones share the label ``OTHER_NAMES``; the log records keep the real name.
LOCK_NAMES_LABELLED = 200
OTHER_NAMES = "(other names)"
_labelled: set[str] = set()


def _lock_label(name: str) -> str:
    if name in _labelled:
        return name
    if len(_labelled) >= LOCK_NAMES_LABELLED:
        return OTHER_NAMES
    _labelled.add(name)  # two threads may both add past the limit: by one or two
    return name


def lock_wait(name: str, seconds: float) -> None:
    # Called on every lock: build the log fields only when they will be logged.
    if log.isEnabledFor(logging.DEBUG):
        _emit("lock_granted", name, waited=round(seconds, 6))
    prom, otel = _prometheus(), _otel.sink()
    if prom is None and otel is None:
        return
    label = _lock_label(name)
    if prom is not None:
        _child("lock_wait", label).observe(seconds)
    if otel is not None:
        otel.lock_wait(name, seconds, label)


def busy(name: str) -> None:
    _emit("lock_busy", name)
    label = _lock_label(name)
    if _prometheus() is not None:
        _child("busy", label).inc()
    if (otel := _otel.sink()) is not None:
        otel.busy(label)


def lock_lost(name: str, reason: str) -> None:
    _emit("lock_lost", name, logging.INFO, reason=reason)
    label = _lock_label(name)
    if _prometheus() is not None:
        _child("lost", label).inc()
    if (otel := _otel.sink()) is not None:
        otel.lock_lost(name, reason, label)


def job_failing(name: str, handler: str, expected: int) -> None:
    """Schedule ``name`` had no success in its last ``expected`` slots (logged once per spell)."""
    _emit("job_failing", name, logging.WARNING, handler=handler, expected_slots=expected)


def job_recovered(name: str, handler: str) -> None:
    _emit("job_recovered", name, logging.INFO, handler=handler)


def jobs_failing(handler: str, count: int) -> None:
    if _prometheus() is not None:
        _child("jobs_failing", handler).set(count)
    if (otel := _otel.sink()) is not None:
        otel.jobs_failing(handler, count)


def parts_owned(name: str, count: int) -> None:
    _emit("parts_owned", name, count=count)
    if (prom := _prometheus()) is not None:
        prom["parts_owned"].labels(name).set(count)
    if (otel := _otel.sink()) is not None:
        otel.parts_owned(name, count)


def slot_started(job: str, at: str, attempt: int, runner: str) -> None:
    if (otel := _otel.sink()) is not None:
        otel.slot_started(job, at, attempt, runner)


def slot_finished(job: str, at: str, outcome: str, seconds: float, handler: str) -> None:
    _emit("slot_finished", job, at=at, outcome=outcome, seconds=round(seconds, 6), handler=handler)
    if (otel := _otel.sink()) is not None:
        otel.slot_finished(job, at, outcome, seconds, handler)
