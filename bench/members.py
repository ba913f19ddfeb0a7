"""Membership: how fast a death is news, and what a member costs in connections.

    python bench/members.py [--rounds 15] [--sizes 5,20]

Crash news: N member processes in one group (ttl 10 s, so that nothing but the
watcher ring can be what told them). Each round SIGKILLs one member, or ends its
session with ``pg_terminate_backend``, and measures, for every survivor, the
time from the event to the survivor's ``MemberLeft`` (wall clocks of one host);
then a replacement joins and the next round starts once everyone has seen it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- a member process ----------------------------------------------------------------------

async def replica(dsn: str, group: str, name: str, ttl: float) -> None:
    import pgcoord

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with pgcoord.Member(dsn, group=group, name=name, ttl=ttl) as member:
        changes = member.watch()
        assert member._main is not None
        print(f"JOINED {member._main.backend_pid}", flush=True)

        async def report() -> None:
            async for change in changes:
                kind = "LEFT" if isinstance(change, pgcoord.MemberLeft) else "JOINED-PEER"
                print(f"{kind} {change.member.name} {time.time():.6f}", flush=True)

        reporter = asyncio.create_task(report())
        await stop.wait()
        reporter.cancel()


# -- the harness -------------------------------------------------------------------------------

class Proc:
    def __init__(self, dsn: str, group: str, name: str, ttl: float) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--replica", dsn, group, name, str(ttl)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def pid(self) -> int | None:
        for line in self.lines:
            if line.startswith("JOINED "):
                return int(line.split()[1])
        return None

    def saw(self, kind: str, name: str) -> float | None:
        for line in self.lines:
            parts = line.split()
            if parts[0] == kind and parts[1] == name:
                return float(parts[2])
        return None


def wait_until(check: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def crash_news(dsn: str, size: int, rounds: int, event: str) -> list[float]:
    import psycopg

    group = f"bench-{uuid.uuid4().hex[:6]}"
    ttl = 10.0
    procs = {f"m{i}": Proc(dsn, group, f"m{i}", ttl) for i in range(size)}
    latencies: list[float] = []
    serial = size
    try:
        if not wait_until(lambda: all(p.pid() for p in procs.values()), 60):
            raise RuntimeError("members did not join")
        time.sleep(0.5)
        with psycopg.connect(dsn, autocommit=True) as admin:
            for _ in range(rounds):
                victim = random.choice(sorted(procs))
                doomed = procs.pop(victim)
                at = time.time()
                if event == "SIGKILL":
                    doomed.proc.kill()
                else:
                    admin.execute("select pg_terminate_backend(%s)", (doomed.pid(),))
                if not wait_until(lambda: all(p.saw("LEFT", victim) for p in procs.values()), 10):
                    raise RuntimeError(f"not every survivor saw {victim} leave")
                latencies += [p.saw("LEFT", victim) - at for p in procs.values()]  # type: ignore[operator]
                doomed.proc.kill()
                doomed.proc.wait()
                name = f"m{serial}"
                serial += 1
                procs[name] = Proc(dsn, group, name, ttl)
                if not wait_until(lambda: all(p.saw("JOINED-PEER", name) for n, p in procs.items()
                                              if n != name), 30):
                    raise RuntimeError(f"{name} did not join")
                time.sleep(0.2)
    finally:
        for p in procs.values():
            p.proc.kill()
            p.proc.wait()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="5,20")
    args = parser.parse_args()
    from bench._server import bench_database

    with bench_database() as (dsn, _server):
        print("| members | event | samples | p50 | p99 | max |")
        print("|---:|---|---:|---:|---:|---:|")
        for size in (int(s) for s in args.sizes.split(",")):
            for event in ("SIGKILL", "pg_terminate_backend"):
                lat = crash_news(dsn, size, args.rounds, event)
                ms = [x * 1000 for x in lat]
                print(f"| {size} | {event} | {len(ms)} | {percentile(ms, 50):.1f} ms | "
                      f"{percentile(ms, 99):.1f} ms | {max(ms):.1f} ms |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        asyncio.run(replica(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])))
    else:
        main()
