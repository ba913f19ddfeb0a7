"""The history of leadership must not slow a takeover: measured with and without it.

    python bench/lease_terms.py [--statements 2000] [--runs 20] [--ttl 2]

The record (pgcoord.lease_terms, migration 0009) is written by triggers on
pgcoord.leases. The baseline is the same database with those triggers disabled
(ALTER TABLE ... DISABLE TRIGGER), measured in the same run, in alternating blocks
so that a neighbour's load falls on both sides alike.

1. The statements that start and end terms, timed from the client over loopback,
   one connection: a takeover of an expired lease (lease_acquire: a term ends
   'expired', one starts, one is pruned), a takeover from a dead session (the
   trigger looks the session up in pg_locks: 'session_ended'), a release, and a
   renewal (which the triggers' WHEN clauses skip).
2. Elector failover end to end (bench/failover.py's fleet of 3 processes): the
   leader SIGKILLed, and stopped gracefully (SIGTERM), from the event to the new
   leader's first statement on the database clock.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRIGGERS = ("lease_terms_started", "lease_terms_changed")
BLOCKS = 4  # alternating with/without blocks per measurement


def record(conn: object, on: bool) -> None:
    for trigger in TRIGGERS:
        conn.execute(f"alter table pgcoord.leases {'enable' if on else 'disable'} trigger {trigger}")  # type: ignore[attr-defined]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def timed(conn: object, statement: str, params: tuple[object, ...]) -> float:
    started = time.perf_counter()
    conn.execute(statement, params).fetchall()  # type: ignore[attr-defined]
    return (time.perf_counter() - started) * 1e6


def statements(dsn: str, n: int) -> dict[str, dict[bool, list[float]]]:
    """Microseconds per statement, by kind and by whether the record was on."""
    import psycopg

    acquire = "select fence from pgcoord.lease_acquire(%s, %s, %s, %s)"
    out: dict[str, dict[bool, list[float]]] = {}

    def add(kind: str, on: bool, us: float) -> None:
        out.setdefault(kind, {True: [], False: []})[on].append(us)

    with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn, autocommit=True) as conn:
        for block in range(BLOCKS * 2):
            on = block % 2 == 0
            record(admin, on)
            name = f"bench-terms:{uuid.uuid4().hex[:8]}"
            conn.execute(acquire, (name, "h0", 1, None))
            for i in range(60):  # past the retention bound: each term now also prunes one
                time.sleep(0.002)  # the 1 ms lease has expired
                conn.execute(acquire, (name, f"w{i}", 1, None))
            for i in range(n // BLOCKS):
                time.sleep(0.002)
                add("takeover, lease expired", on, timed(conn, acquire, (name, f"e{i}", 1, None)))
            # Takeovers from a session that is gone: holder_pid names no session
            # holding the doorbell, the lease has not expired.
            dead = f"bench-terms-dead:{uuid.uuid4().hex[:8]}"
            conn.execute(acquire, (dead, "d", 60000, 999_999))
            for i in range(n // BLOCKS):
                add("takeover, session gone", on, timed(conn, acquire, (dead, f"d{i}", 60000, 999_999)))
            # A release, then the next acquire (a handover's two statements).
            free = f"bench-terms-free:{uuid.uuid4().hex[:8]}"
            for _ in range(n // BLOCKS):
                [(f,)] = conn.execute(acquire, (free, "r", 60000, None)).fetchall()
                add("release", on, timed(conn, "select pgcoord.lease_release(%s, 'r', %s)", (free, f)))
            # Renewals: the triggers' WHEN clauses skip them.
            [(f,)] = conn.execute(acquire, (free, "r", 60000, None)).fetchall()
            for _ in range(n // BLOCKS):
                add("renewal", on, timed(conn, "select pgcoord.lease_renew(%s, 'r', %s, 60000)", (free, f)))
        record(admin, True)
    return out


def failovers(dsn: str, runs: int, ttl: float) -> dict[str, dict[bool, list[float]]]:
    import psycopg

    from bench.failover import Fleet

    out: dict[str, dict[bool, list[float]]] = {}
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("create table if not exists bench_elections (id serial primary key,"
                      " replica text, fence bigint, at timestamptz default clock_timestamp())")
        for scenario in ("SIGKILL", "SIGTERM"):
            for block in range(BLOCKS):
                on = block % 2 == 0
                record(admin, on)
                fleet = Fleet(dsn, ttl, baseline=False)
                try:
                    for _ in range(max(1, runs * 2 // BLOCKS)):
                        took = fleet.run_once(scenario) * 1000
                        out.setdefault(scenario, {True: [], False: []})[on].append(took)
                finally:
                    fleet.close()
        record(admin, True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--statements", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ttl", type=float, default=2.0)
    args = parser.parse_args()

    from bench._server import bench_database

    with bench_database() as (dsn, _):
        print(f"# Leadership history: takeovers with and without the record ({time.strftime('%Y-%m-%d')}, "
              f"{os.cpu_count()} cores, loopback)\n")
        print(f"Statements, one connection, {args.statements} of each per side, in {BLOCKS} "
              "alternating blocks (microseconds, client round trip):\n")
        print("| statement | with record p50 | p99 | without p50 | p99 | ratio p50 |")
        print("|---|---:|---:|---:|---:|---:|")
        for kind, sides in statements(dsn, args.statements).items():
            on, off = sides[True], sides[False]
            print(f"| {kind} | {pct(on, .5):,.0f} | {pct(on, .99):,.0f} | {pct(off, .5):,.0f} | "
                  f"{pct(off, .99):,.0f} | {pct(on, .5) / pct(off, .5):.2f} |", flush=True)
        print(f"\nElector failover, 3 processes, ttl {args.ttl:g} s, {args.runs} runs per side "
              "(milliseconds, event to the new leader's first statement):\n")
        print("| event | with record p50 | p99 | without p50 | p99 |")
        print("|---|---:|---:|---:|---:|")
        for scenario, sides in (failovers(dsn, args.runs, args.ttl) if args.runs else {}).items():
            on, off = sides[True], sides[False]
            label = "SIGTERM (graceful handover)" if scenario == "SIGTERM" else "SIGKILL (takeover)"
            print(f"| {label} | {pct(on, .5):,.1f} | {pct(on, .99):,.1f} | {pct(off, .5):,.1f} | "
                  f"{pct(off, .99):,.1f} |", flush=True)


if __name__ == "__main__":
    main()
