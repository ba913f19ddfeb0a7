"""PostgreSQL failover: from the primary's death to pgcoord working again, in one run.

    python bench/ha.py [--runs 5] [--ttl 2]

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
import os
import statistics
import sys
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ttl", type=float, default=2.0)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.ttl))
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in runs[-1].items()),
              file=sys.stderr, flush=True)
    from pgcoord._core.embedded import find_bindir

    print(f"\nPostgreSQL failover, {args.runs} runs, ttl {args.ttl:g} s, server {find_bindir()}")
    print(f"{'from the primary killed to':<46} {'median':>8} {'max':>8} {'vs promotion':>13}")
    base = statistics.median(r["promoted"] for r in runs)
    for title, key in ROWS:
        values = [r[key] for r in runs]
        median = statistics.median(values)
        print(f"{title:<46} {median * 1000:>6.0f} ms {max(values) * 1000:>5.0f} ms "
              f"{median / base:>12.1f}x")


if __name__ == "__main__":
    main()
