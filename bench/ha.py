"""PostgreSQL failover: from the primary's death to pgcoord working again, in one run.

    python bench/ha.py [--runs 5] [--ttl 2] [--patroni-runs 1]

Part two (``--patroni-runs``, 0 to leave it out) does the same on a real Patroni
cluster (tests/ha_patroni/patroni.py: etcd and two nodes, synchronous_mode, ttl 20,
loop_wait 2, primary_start_timeout 0), for each event Patroni meets: a switchover,
a SIGKILL of the primary's postmaster, etcd stopped for 20 s, and the same with
failsafe_mode. From the event to: a primary writable, a leader again (plain elector),
the first fenced write accepted on the new primary, the next slot started. The
hand-made promotion of part one, measured in the same run, is the baseline.

Each run starts a primary and a synchronous streaming standby on loopback
(tests/integration/ha.py) and the HA test's three replica processes (asyncpg,
psycopg, SQLAlchemy; each with an elector, an elector on a Member, two
LockHolders, a Lease holder making fenced writes and a per-second scheduler job),
all on multi-host DSNs with target_session_attrs=read-write. Then the primary is
stopped at once (SIGQUIT) and the standby promoted with ``pg_ctl promote``, as an
operator or Patroni would.

Measured from the kill, on the one machine's clock: the promotion itself (the
baseline: nothing can write before it), then each feature's first sign of life
on the new primary — a new leader (plain elector and elector on a member), the
first fenced write accepted under the lease (its holder usually keeps it: the row
was replicated; when its pool reconnects too slowly it loses it and the lease is
taken anew), every LockHolder body holding its lock again, and the scheduler's
next slot started (slots are whole seconds, so this adds up to 1 s of waiting
for the slot to come due).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = (("promotion (the standby takes writes)", "promoted"),
        ("new leader: Elector(dsn)", "elector"),
        ("new leader: Elector(member)", "member-elector"),
        ("first fenced write accepted under the lease", "lease"),
        ("every LockHolder body holds its lock again", "locks"),
        ("scheduler's next slot started", "slot"))


def one_run(ttl: float) -> dict[str, float]:
    import pgcoord.migrations
    from tests.integration.ha import Fleet, StandbyPair

    with StandbyPair(synchronous=True) as pair:
        pgcoord.migrations.upgrade(pair.url())
        fleet = Fleet(pair, "postgres", ttl=ttl)
        try:
            keys = [f"{fleet.prefix}:{kind}:{label}" for label in fleet.procs for kind in ("lock", "mlock")]
            fleet.wait_for("lead", fleet.name("elector"))
            fleet.wait_for("lead", fleet.name("member-elector"))
            fleet.wait_for("lease", fleet.name("lease"))
            for key in keys:
                fleet.wait_for("locked", key)
            fleet.wait_for("slot", fleet.name("job"), count=2)
            time.sleep(0.3)
            killed = time.time()
            pair.fail_over()
            took = {"promoted": time.time() - killed}
            for what, feature in (("lead", "elector"), ("lead", "member-elector"),
                                  ("resumed", "lease"), ("slot", "job")):
                first = fleet.wait_for(what, fleet.name(feature), after=killed, timeout=ttl + 15)[0]
                took[feature if what != "slot" else "slot"] = first.at - killed
            took["locks"] = max(fleet.wait_for("locked", key, after=killed, timeout=15)[0].at - killed
                                for key in keys)
            return took
        finally:
            fleet.stop()


PATRONI_EVENTS = ("switchover", "sigkill", "dcs-loss", "dcs-loss-failsafe")
PATRONI_COLUMNS = (("primary writable", "writable"), ("leader again", "leader"),
                   ("fenced write", "write"), ("next slot", "slot"))


def patroni_runs(runs: int, ttl: float) -> dict[str, list[dict[str, float]]]:
    """Each Patroni event ``runs`` times on one cluster and one fleet."""
    import pgcoord.migrations
    from tests.ha_patroni.patroni import PatroniCluster
    from tests.integration.ha import Fleet

    found: dict[str, list[dict[str, float]]] = {e: [] for e in PATRONI_EVENTS}
    with PatroniCluster(ttl=20, loop_wait=2, retry_timeout=4) as cluster:
        pgcoord.migrations.upgrade(cluster.url())
        fleet = Fleet(cluster, "postgres", ttl=ttl)
        try:
            fleet.wait_for("lead", fleet.name("elector"), timeout=60)
            fleet.wait_for("slot", fleet.name("job"), count=2, timeout=60)
            for i in range(runs):
                for event in PATRONI_EVENTS:
                    cluster.edit_config(failsafe_mode=event == "dcs-loss-failsafe")
                    cluster.wait_healthy(timeout=90)
                    time.sleep(3)  # a loop or two of Patroni's, and fenced writes
                    t0, writable = _event(cluster, event)
                    took = {"writable": writable - t0}
                    elector, lease = fleet.name("elector"), fleet.name("lease")
                    if event == "dcs-loss-failsafe":  # etcd is back: nothing should have stopped
                        leads = [e for e in fleet.events("lead", elector) if e.at > t0]
                        took["leader"] = leads[0].at - t0 if leads else 0.0
                        resumed = [e for e in fleet.events("resumed") if e.at > t0
                                   and e.name in (elector, lease)]
                        took["write"] = resumed[0].at - t0 if resumed else 0.0
                    else:
                        took["leader"] = fleet.wait_for("lead", elector, after=t0, timeout=90)[0].at - t0
                        took["write"] = fleet.wait_for("resumed", elector, after=t0, timeout=90)[0].at - t0
                        with contextlib.suppress(AssertionError):  # the lease's holder may be writing on
                            took["write"] = min(took["write"], fleet.wait_for(
                                "resumed", lease, after=t0, timeout=0.1)[0].at - t0)
                    took["slot"] = fleet.wait_for("slot", fleet.name("job"), after=writable,
                                                  timeout=60)[0].at - t0
                    found[event].append(took)
                    print(f"patroni run {i + 1}/{runs} {event}: " + ", ".join(
                        f"{k} {v * 1000:.0f} ms" for k, v in took.items()), file=sys.stderr, flush=True)
        finally:
            fleet.stop()
    return found


def _takes_a_write(cluster: object) -> bool:
    import psycopg

    from tests.ha_patroni.patroni import PatroniCluster

    assert isinstance(cluster, PatroniCluster)
    node = cluster.writable()
    if node is None:
        return False
    try:
        with psycopg.connect(node.dsn, autocommit=True, connect_timeout=1) as conn:
            conn.execute("create temporary table pgcoord_probe (x int)")
        return True
    except psycopg.Error:
        return False


def _event(cluster: object, event: str) -> tuple[float, float]:
    """Start the event; (its unix time, when a primary took writes again). The
    node that takes writes is polled from the event on, beside patronictl (which
    returns only once the switchover is done). The DCS loss demotes the primary some
    seconds in: etcd is brought back 20 s after it stopped."""
    from tests.ha_patroni.patroni import PatroniCluster

    assert isinstance(cluster, PatroniCluster)
    old = cluster.wait_writable()
    t0 = time.time()
    if event in ("switchover", "sigkill"):
        act = threading.Thread(target=cluster.switchover if event == "switchover" else cluster.kill_primary)
        act.start()
        while (node := cluster.writable()) is None or node is old:
            time.sleep(0.01)
        writable = time.time()
        act.join()
        return t0, writable
    cluster.stop_etcd()
    if event == "dcs-loss-failsafe":
        # Failsafe should keep the primary writable: "writable" is then the longest
        # the outage went without a write accepted, from its start (a demotion
        # would show here as seconds, not be assumed away).
        accepted, longest, took = t0, 0.0, False
        while time.time() - t0 < 20:
            if took := _takes_a_write(cluster):
                longest, accepted = max(longest, time.time() - accepted), time.time()
            time.sleep(0.05)
        cluster.start_etcd()
        if not took:  # not writable when etcd came back: until a primary is
            cluster.wait_writable(timeout=90, poll=0.01)
            longest = max(longest, time.time() - accepted)
        return t0, t0 + longest
    while cluster.writable() is not None and time.time() - t0 < 20:
        time.sleep(0.05)
    time.sleep(max(0.0, 20 - (time.time() - t0)))
    cluster.start_etcd()
    cluster.wait_writable(timeout=90, poll=0.01)
    return t0, time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument("--patroni-runs", type=int, default=1)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.ttl))
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in runs[-1].items()),
              file=sys.stderr, flush=True)
    patroni = patroni_runs(args.patroni_runs, args.ttl) if args.patroni_runs else {}
    from pgcoord._core.embedded import find_bindir

    if runs:
        print(f"\nPostgreSQL failover, {args.runs} runs, ttl {args.ttl:g} s, server {find_bindir()}")
        print(f"{'from the primary killed to':<46} {'median':>8} {'max':>8} {'vs promotion':>13}")
        base = statistics.median(r["promoted"] for r in runs)
        for title, key in ROWS:
            values = [r[key] for r in runs]
            median = statistics.median(values)
            print(f"{title:<46} {median * 1000:>6.0f} ms {max(values) * 1000:>5.0f} ms "
                  f"{median / base:>12.1f}x")
    if patroni:
        print(f"\nPatroni (ttl 20, loop_wait 2, synchronous_mode), pgcoord ttl {args.ttl:g} s; "
              f"median of {args.patroni_runs}, from the event to:")
        print(f"{'event':<34}" + "".join(f"{title:>18}" for title, _ in PATRONI_COLUMNS))
        if runs:
            hand = {"writable": [r["promoted"] for r in runs], "leader": [r["elector"] for r in runs],
                    "write": [r["lease"] for r in runs], "slot": [r["slot"] for r in runs]}
            print(f"{'pg_ctl promote (baseline)':<34}" + "".join(
                f"{statistics.median(hand[key]) * 1000:>15.0f} ms" for _, key in PATRONI_COLUMNS))
        for event, taken in patroni.items():
            print(f"{'patroni ' + event:<34}" + "".join(
                f"{statistics.median(t[key] for t in taken) * 1000:>15.0f} ms" for _, key in PATRONI_COLUMNS))


if __name__ == "__main__":
    main()
