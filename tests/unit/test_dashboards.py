"""The Grafana dashboard and the Prometheus alert rules in docs/dashboards name only
metrics that pgcoord exports (a renamed metric must not leave a silent panel)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from pgcoord import metrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "docs" / "dashboards"
_METRIC = re.compile(r"\bpgcoord_[a-z_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def exported() -> set[str]:
    metrics.warm_up()
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return {n for n in names if n.startswith("pgcoord_")}


def base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


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


def test_a_renamed_metric_would_be_caught() -> None:
    have = exported()
    assert "pgcoord_no_such_metric" not in have and base("pgcoord_no_such_metric_total") not in have
