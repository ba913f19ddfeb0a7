"""Elector failover: pgcoord against a lease-polling baseline, measured in one run.

    python bench/failover.py [--runs 20] [--ttls 1,10]

Three replica processes elect a leader for one lease. Each run does one thing
to the leader — SIGKILL, SIGSTOP (held until someone else leads), or SIGTERM
(graceful stop) — and measures the takeover time: from the event to the new
leader's first statement, both read on the database clock. The baseline is the
design other Postgres electors use: every replica polls the lease at ttl/3 and
takes over once it has expired; it resigns by releasing the row on SIGTERM.
Both sides use the same lease table and SQL functions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the replica processes ---------------------------------------------------------------

async def replica(dsn: str, name: str, ttl: float, label: str, baseline: bool) -> None:
    import asyncpg

    import pgcoord
    from pgcoord._core.queries import query

    conn = await asyncpg.connect(dsn)

    async def lead(fence: int) -> None:
        await conn.execute("insert into bench_elections (replica, fence) values ($1, $2)",
                           label, fence)
        await asyncio.sleep(3600)

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    if not baseline:
        elector = pgcoord.Elector(dsn, name, ttl=ttl, holder=label)
        runner = asyncio.create_task(elector.run(lead))
        await stop.wait()
        await elector.stop()
        await runner
        return
    # Baseline: poll at ttl/3, take over on expiry, renew at ttl/3.
    session = await asyncpg.connect(dsn)
    ttl_ms, fence = int(ttl * 1000), None
    while not stop.is_set():
        if fence is None:
            fence = await session.fetchval(query("lease_acquire"), name, label, ttl_ms, None)
            if fence is not None:
                await lead_once(conn, label, fence)
        elif await session.fetchval(query("lease_renew"), name, label, fence, ttl_ms) is None:
            fence = None
        try:
            await asyncio.wait_for(stop.wait(), ttl / 3)
        except TimeoutError:
            pass
    if fence is not None:
        await session.fetchval(query("lease_release"), name, label, fence)


async def lead_once(conn: object, label: str, fence: int) -> None:
    await conn.execute("insert into bench_elections (replica, fence) values ($1, $2)",  # type: ignore[attr-defined]
                       label, fence)


# -- the driver ----------------------------------------------------------------------------

class Fleet:
    def __init__(self, dsn: str, ttl: float, baseline: bool) -> None:
        import psycopg

        self.psycopg = psycopg
        self.dsn, self.ttl, self.baseline = dsn, ttl, baseline
        self.name = f"bench-failover:{uuid.uuid4().hex[:6]}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._conn = None
        self.counter = 0
        for _ in range(3):
            self.spawn()

    def spawn(self) -> None:
        self.counter += 1
        label = f"{self.name}/r{self.counter}"
        self.procs[label] = subprocess.Popen(
            [sys.executable, __file__, "--replica", self.dsn, self.name, str(self.ttl), label,
             "baseline" if self.baseline else "pgcoord"], stdin=subprocess.DEVNULL)

    def sql(self, statement: str, *params: object) -> list[tuple[object, ...]]:
        # One connection for the whole run: opening one per poll would fork a
        # backend every few milliseconds and steal the CPU being measured.
        if self._conn is None:
            self._conn = self.psycopg.connect(self.dsn, autocommit=True)
        return self._conn.execute(statement, params or None).fetchall()

    def last_election(self) -> tuple[str, int, float] | None:
        rows = self.sql("select replica, fence, extract(epoch from at) from bench_elections"
                        " where replica = any(%s) order by id desc limit 1", list(self.procs))
        return None if not rows else (str(rows[0][0]), int(rows[0][1]), float(rows[0][2]))  # type: ignore[call-overload, arg-type]

    def wait_new_leader(self, after_fence: int, timeout: float) -> tuple[str, int, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.last_election()
            if last is not None and last[1] > after_fence:
                return last
            time.sleep(0.005)
        raise RuntimeError(f"no new leader after fence {after_fence}: {self.last_election()}, "
                           f"procs {[(k, p.poll()) for k, p in self.procs.items()]}, lease "
                           f"{self.sql('select * from pgcoord.leases where name = %s', self.name)}")

    def now(self) -> float:
        return float(self.sql("select extract(epoch from clock_timestamp())")[0][0])  # type: ignore[arg-type]

    def run_once(self, scenario: str) -> float:
        current = self.wait_new_leader(0, 60) if self.last_election() is None else self.last_election()
        assert current is not None
        leader, fence, elected = current
        # Let the leader settle into its renewal rhythm at a random phase.
        time.sleep(self.ttl / 3 + (uuid.uuid4().int % 1000) / 1000 * self.ttl / 3)
        proc = self.procs[leader]
        at = self.now()
        if scenario == "SIGKILL":
            proc.kill()
        elif scenario == "SIGSTOP":
            proc.send_signal(signal.SIGSTOP)
        else:
            proc.send_signal(signal.SIGTERM)
        _, _, new_at = self.wait_new_leader(fence, self.ttl * 3 + 10)
        took = new_at - at
        if scenario == "SIGSTOP":
            proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=None) if scenario != "SIGSTOP" else None
        if scenario != "SIGSTOP":
            del self.procs[leader]
            self.spawn()
        return took

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        for proc in self.procs.values():
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ttls", default="1,10")
    parser.add_argument("--replica", nargs=5, metavar=("DSN", "NAME", "TTL", "LABEL", "KIND"))
    args = parser.parse_args()
    if args.replica:
        dsn, name, ttl, label, kind = args.replica
        asyncio.run(replica(dsn, name, float(ttl), label, kind == "baseline"))
        return

    from bench._server import bench_database

    with bench_database() as (dsn, _):
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create table if not exists bench_elections (id serial primary key,"
                         " replica text, fence bigint, at timestamptz default clock_timestamp())")
        print(f"# Failover benchmark ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, loopback, "
              f"3 replica processes, {args.runs} runs each)\n")
        print("| ttl | event | pgcoord p50 | pgcoord p99 | baseline p50 | baseline p99 |")
        print("|---:|---|---:|---:|---:|---:|")
        for ttl in (float(t) for t in args.ttls.split(",")):
            for scenario in ("SIGKILL", "SIGSTOP", "SIGTERM (graceful)"):
                results = {}
                for baseline in (False, True):
                    fleet = Fleet(dsn, ttl, baseline)
                    try:
                        results[baseline] = [fleet.run_once(scenario.split()[0]) * 1000
                                             for _ in range(args.runs)]
                    finally:
                        fleet.close()
                ours, base = results[False], results[True]
                print(f"| {ttl:g} s | {scenario} | {pct(ours, .5):,.0f} ms | {pct(ours, .99):,.0f} ms | "
                      f"{pct(base, .5):,.0f} ms | {pct(base, .99):,.0f} ms |", flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda args: None
    main()
