"""``pgcoord doctor --patroni URL`` against a real Patroni cluster configured to earn each
verdict, one after the other on one cluster (its configuration changed at run time
through PATCH /config, as ``patronictl edit-config`` does)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import pgcoord.migrations
from pgcoord.cli.doctor import Check, run_checks

from .patroni import PatroniCluster, _free_low_port

ROOT = Path(__file__).resolve().parents[2]
# A cluster to start (about 20 s) and each verdict's configuration to earn.
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PatroniCluster]:
    with PatroniCluster(ttl=20, loop_wait=2, retry_timeout=4) as cluster:
        pgcoord.migrations.upgrade(cluster.url())
        yield cluster


def doctor(cluster: PatroniCluster, *urls: str, ttl: float | None = None) -> dict[str, Check]:
    checks = run_checks(cluster.libpq_dsn(), patroni=list(urls or cluster.api_urls), ttl=ttl)
    return {c.name: c for c in checks}


def until(what: str, predicate: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s")
        time.sleep(0.2)


def test_a_synchronous_cluster_passes_and_failsafe_is_reported(cluster: PatroniCluster) -> None:
    checks = doctor(cluster, ttl=60)
    assert checks["patroni"].status == "pass", checks["patroni"]
    assert "synchronous_mode True" in checks["patroni"].detail
    assert checks["patroni_ttl"].status == "pass"
    assert "ttl 20 s + loop_wait 2 s" in checks["patroni_ttl"].detail
    assert checks["patroni_members"].status == "pass", checks["patroni_members"]
    assert checks["patroni_failsafe"].status == "pass"
    assert "failsafe_mode off" in checks["patroni_failsafe"].detail
    # Both nodes of one cluster were named: its checks come once.
    assert sum(1 for c in run_checks(cluster.libpq_dsn(), patroni=cluster.api_urls, ttl=60)
               if c.name == "patroni") == 1


def test_a_pgcoord_ttl_shorter_than_a_failover_warns(cluster: PatroniCluster) -> None:
    checks = doctor(cluster, ttl=4)
    assert checks["patroni_ttl"].status == "warn"
    assert "22 s" in checks["patroni_ttl"].fix and "greater fence" in checks["patroni_ttl"].fix


def test_without_ttl_the_held_leases_ttls_are_compared(cluster: PatroniCluster) -> None:
    assert "no pgcoord lease" in doctor(cluster)["patroni_ttl"].detail
    with psycopg.connect(cluster.libpq_dsn(), autocommit=True) as conn:
        conn.execute("insert into pgcoord.leases (name, holder, fence, acquired_at, renewed_at, expires_at)"
                     " values ('doctor:short', 'h', 1, now(), now(), now() + interval '5 s'),"
                     " ('doctor:long', 'h', 1, now(), now(), now() + interval '60 s')")
        try:
            check = doctor(cluster)["patroni_ttl"]
        finally:
            conn.execute("delete from pgcoord.leases where name like 'doctor:%'")
    assert check.status == "warn"
    assert "pgcoord ttls 5-60 s" in check.detail


def test_synchronous_mode_off_warns_that_a_fence_can_go_back(cluster: PatroniCluster) -> None:
    cluster.edit_config(synchronous_mode=False)
    try:
        check = doctor(cluster, ttl=60)["patroni"]
        assert check.status == "warn"
        assert "synchronous_mode is off" in check.detail and "fence" in check.fix
    finally:
        cluster.edit_config(synchronous_mode=True)
        cluster.wait_healthy()


def test_failsafe_mode_on_is_reported(cluster: PatroniCluster) -> None:
    cluster.edit_config(failsafe_mode=True)
    try:
        check = doctor(cluster, ttl=60)["patroni_failsafe"]
        assert check.status == "pass" and "failsafe_mode on" in check.detail
    finally:
        cluster.edit_config(failsafe_mode=False)


def test_a_standby_lagging_past_maximum_lag_on_failover_warns(cluster: PatroniCluster) -> None:
    primary = cluster.wait_healthy()
    standby = next(n for n in cluster.nodes if n is not primary)
    cluster.edit_config(maximum_lag_on_failover=65536)
    with psycopg.connect(standby.dsn, autocommit=True) as conn:
        [(receiver,)] = conn.execute("select pid from pg_stat_wal_receiver").fetchall()
    # The standby's WAL receiver frozen: it still shows as streaming, and receives
    # nothing while the primary writes a few MB (not waiting for it: local commits).
    os.kill(receiver, signal.SIGSTOP)
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("set synchronous_commit = local")
            conn.execute("create table if not exists doctor_lag as select g, repeat('x', 200) as pad"
                         " from generate_series(1, 20000) g")
        until("lag shown", lambda: doctor(cluster, ttl=60)["patroni_members"].status == "warn", 15)
        check = doctor(cluster, ttl=60)["patroni_members"]
        assert "past maximum_lag_on_failover 65536" in check.detail, check
    finally:
        os.kill(receiver, signal.SIGCONT)
        cluster.edit_config(maximum_lag_on_failover=1048576)
        cluster.wait_healthy(timeout=90)


def test_a_stopped_standby_is_not_streaming(cluster: PatroniCluster) -> None:
    primary = cluster.wait_healthy()
    standby = next(n for n in cluster.nodes if n is not primary)
    cluster.stop_node(standby)
    try:
        # Its REST API is gone too: the primary's still answers for the cluster.
        until("standby gone",
              lambda: doctor(cluster, primary.api, ttl=60)["patroni_members"].status == "warn")
        check = doctor(cluster, primary.api, ttl=60)["patroni_members"]
        assert "not streaming" in check.detail or "no standby" in check.detail, check
    finally:
        cluster.start_node(standby)
        cluster.wait_healthy(timeout=90)


def test_an_unreachable_url_is_a_failure_line_not_a_traceback(cluster: PatroniCluster) -> None:
    closed = f"http://127.0.0.1:{_free_low_port()}"
    result = subprocess.run(
        [sys.executable, "-m", "pgcoord.cli", "doctor", "--dsn", cluster.libpq_dsn(), "--patroni", closed,
         "--patroni", cluster.nodes[0].api, "--ttl", "60", "--json"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.stdout, result.stderr)
    checks = json.loads(result.stdout)["checks"]
    failed = [c for c in checks if c["name"] == "patroni" and c["status"] == "fail"]
    assert len(failed) == 1 and closed in failed[0]["detail"], checks
    assert any(c["name"] == "patroni_members" for c in checks)  # the other URL was read
