"""The Grafana dashboard and the Prometheus alert rules in docs/dashboards name only
metrics that pgcoord exports (a renamed metric must not leave a silent panel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from pgcoord.observability import metrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "docs" / "dashboards"
_METRIC = re.compile(r"\bpgcoord_[a-z_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


# The series names Prometheus scrapes for each kind of metric family.
_SERIES = {"counter": ("_total", "_created"), "gauge": ("",),
           "histogram": ("_bucket", "_count", "_sum", "_created")}


def exported() -> set[str]:
    """Every series name pgcoord's metrics can be scraped as (a counter as *_total, a
    histogram as *_bucket/_count/_sum, a gauge as itself)."""
    metrics.warm_up()
    names: set[str] = set()
    for family in REGISTRY.collect():
        if family.name.startswith("pgcoord_"):
            names.update(family.name + suffix for suffix in _SERIES[family.type])
    return names


def base(name: str) -> str:
    return name  # series names are matched exactly (see exported())


def named_in(text: str) -> set[str]:
    return set(_METRIC.findall(text))


def test_every_metric_the_dashboard_plots_exists() -> None:
    dashboard = json.loads((DASHBOARDS / "grafana-pgcoord.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set().union(*(named_in(e) for e in exprs))
    assert used, "the dashboard plots nothing"
    have = exported()
    missing = sorted(n for n in used if n not in have and base(n) not in have)
    assert missing == []


def test_every_metric_the_alert_rules_use_exists() -> None:
    text = (DASHBOARDS / "prometheus-alerts.yml").read_text()
    exprs = re.findall(r"^\s+expr:\s*(.+)$", text, re.MULTILINE)
    alerts = re.findall(r"^\s+- alert:\s*(\w+)$", text, re.MULTILINE)
    assert len(exprs) == len(alerts) >= 4
    for wanted in ("PgcoordNoLeader", "PgcoordJobFailing", "PgcoordLockWaitSlow", "PgcoordLocksLost"):
        assert wanted in alerts
    used = set().union(*(named_in(e) for e in exprs))
    have = exported()
    assert sorted(n for n in used if n not in have and base(n) not in have) == []


def test_a_wrong_name_or_suffix_would_be_caught() -> None:
    have = exported()
    assert "pgcoord_locks_lost_total" in have and "pgcoord_lock_wait_seconds_bucket" in have
    assert "pgcoord_is_leader" in have
    for wrong in ("pgcoord_no_such_metric", "pgcoord_is_leader_total", "pgcoord_locks_lost",
                  "pgcoord_lock_wait_seconds"):
        assert wrong not in have


def test_grouping_labels_exist_on_the_metrics_they_group() -> None:
    labels: dict[str, set[str]] = {}
    metrics.warm_up()
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - label names are not public
        names = getattr(collector, "_labelnames", None)
        name = getattr(collector, "_name", "")
        if names is not None and name.startswith("pgcoord_"):
            labels[name] = set(names) | {"le", "instance", "job"}
    texts = [t["expr"] for p in json.loads((DASHBOARDS / "grafana-pgcoord.json").read_text())["panels"]
             for t in p["targets"]]
    texts += re.findall(r"^\s+expr:\s*(.+)$", (DASHBOARDS / "prometheus-alerts.yml").read_text(), re.MULTILINE)
    for expr in texts:
        for grouping, inner in re.findall(r"by \(([^)]*)\)\s*\((.*)", expr):
            used = named_in(inner)
            families = {n for n in labels if any(u.startswith(n) for u in used)}
            for label in (x.strip() for x in grouping.split(",")):
                assert any(label in labels[f] for f in families), (label, expr)
