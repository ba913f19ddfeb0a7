"""Partitions: how fast a dead member's parts are owned again, and how many parts
a join or a leave moves against the minimum.

    python bench/partitions.py [--parts 256] [--procs 8] [--rounds 10]

N processes (tests/integration/partitions_replica.py, member ttl 10 s so that
nothing but the session's end can free a part early) share the parts. Each
round SIGKILLs one process and takes, from the wall clocks of the survivors'
output, the time from the kill to each orphaned part's new own() starting, and
to the survivors hearing ``MemberLeft`` (the baseline in the same run: the
member's own crash news, which the takeover must follow). A replacement then
joins, and the parts its arrival moved are counted against the minimum (its
share: every part it takes had to move, and no other part should). Last, one
process leaves gracefully (SIGTERM) and the parts that move are counted against
its own count.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPLICA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "integration", "partitions_replica.py")


class Fleet:
    def __init__(self, dsn: str, name: str, count: int) -> None:
        self.dsn, self.name, self.count = dsn, name, count
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: dict[str, list[str]] = {}
        self.seq = 0

    def spawn(self) -> str:
        member = f"p{self.seq}"
        self.seq += 1
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
        proc = subprocess.Popen([sys.executable, REPLICA, self.dsn, self.name, str(self.count), member, "10",
                                 "asyncpg"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        lines: list[str] = []
        self.procs[member], self.lines[member] = proc, lines
        threading.Thread(target=lambda: [lines.append(ln.strip()) for ln in proc.stdout],  # type: ignore[union-attr]
                         daemon=True).start()
        return member

    def live(self) -> list[str]:
        return [m for m, p in self.procs.items() if p.poll() is None]

    def running(self, member: str) -> set[int]:
        now: set[int] = set()
        for line in list(self.lines[member]):
            word, *rest = line.split()
            if word == "OWN":
                now.add(int(rest[0]))
            elif word == "END":
                now.discard(int(rest[0]))
        return now

    def balanced(self) -> bool:
        live = self.live()
        sizes = [len(self.running(m)) for m in live]
        return (sum(sizes) == self.count and set().union(*(self.running(m) for m in live)) == set(range(self.count))
                and max(sizes) - min(sizes) <= 1)

    def wait(self, check, timeout: float = 30.0) -> float:  # type: ignore[no-untyped-def]
        started = time.monotonic()
        while not check():
            if time.monotonic() - started > timeout:
                raise SystemExit(f"timed out after {timeout}s")
            time.sleep(0.01)
        return time.monotonic() - started

    def mark(self) -> dict[str, int]:
        return {m: len(lines) for m, lines in self.lines.items()}

    def since(self, mark: dict[str, int], member: str) -> list[list[str]]:
        return [ln.split() for ln in self.lines[member][mark.get(member, 0):]]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", type=int, default=256)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    from bench._server import bench_database

    with bench_database() as (dsn, _server):
        fleet = Fleet(dsn, f"bench-{uuid.uuid4().hex[:6]}", args.parts)
        try:
            for _ in range(args.procs):
                fleet.spawn()
            settle = fleet.wait(fleet.balanced, timeout=60)
            print(f"{args.parts} parts over {args.procs} processes: balanced {settle:.2f} s after start")
            time.sleep(0.5)
            part_ms: list[float] = []
            all_ms: list[float] = []
            news_ms: list[float] = []
            join_moves: list[tuple[int, int, float]] = []
            for _ in range(args.rounds):
                victim = fleet.live()[0]
                orphans = fleet.running(victim)
                mark = fleet.mark()
                killed = time.time()
                fleet.procs[victim].kill()
                survivors = [m for m in fleet.live() if m != victim]
                fleet.wait(lambda: orphans <= set().union(*(fleet.running(m) for m in survivors)), timeout=30)
                took: dict[int, float] = {}
                for m in survivors:
                    for words in fleet.since(mark, m):
                        if words[0] == "OWN" and int(words[1]) in orphans:
                            took[int(words[1])] = max(took.get(int(words[1]), 0.0), float(words[3]) - killed)
                        if words[:2] == ["LEFT", victim]:
                            news_ms.append((float(words[2]) - killed) * 1000)
                part_ms += [t * 1000 for t in took.values()]
                all_ms.append(max(took.values()) * 1000)
                fleet.wait(fleet.balanced, timeout=30)
                time.sleep(0.3)
                # A replacement joins: what moves?
                mark = fleet.mark()
                joined_at = time.monotonic()
                newcomer = fleet.spawn()
                fleet.wait(fleet.balanced, timeout=30)
                took_s = time.monotonic() - joined_at
                time.sleep(0.3)
                moved = sum(1 for m in fleet.live() for w in fleet.since(mark, m) if w[0] == "OWN")
                join_moves.append((moved, len(fleet.running(newcomer)), took_s))
            # One leaves gracefully.
            leaver = fleet.live()[0]
            its = len(fleet.running(leaver))
            mark = fleet.mark()
            left_at = time.monotonic()
            fleet.procs[leaver].send_signal(signal.SIGTERM)
            fleet.wait(lambda: fleet.procs[leaver].poll() is not None and fleet.balanced(), timeout=30)
            leave_s = time.monotonic() - left_at
            time.sleep(0.3)
            leave_moved = sum(1 for m in fleet.live() for w in fleet.since(mark, m) if w[0] == "OWN")
        finally:
            fleet.stop()

    print()
    print(f"SIGKILL of one of {args.procs} processes, {args.rounds} rounds (ttl 10 s):")
    print(f"{'':44} {'p50':>8} {'p99':>8} {'max':>8}")
    print(f"{'kill -> MemberLeft heard (baseline), ms':44} {pct(news_ms, .5):8.1f} {pct(news_ms, .99):8.1f}"
          f" {max(news_ms):8.1f}")
    print(f"{'kill -> an orphaned part owned again, ms':44} {pct(part_ms, .5):8.1f} {pct(part_ms, .99):8.1f}"
          f" {max(part_ms):8.1f}")
    print(f"{'kill -> every orphaned part owned again, ms':44} {pct(all_ms, .5):8.1f} {pct(all_ms, .99):8.1f}"
          f" {max(all_ms):8.1f}")
    print(f"ratio (every part owned / news heard), p50: {pct(all_ms, .5) / pct(news_ms, .5):.2f}x")
    print()
    print(f"{'change':10} {'moved':>6} {'minimum':>8} {'balanced after':>15}")
    for moved, minimum, took_s in join_moves:
        print(f"{'join':10} {moved:6d} {minimum:8d} {took_s:13.2f} s")
    print(f"{'leave':10} {leave_moved:6d} {its:8d} {leave_s:13.2f} s")


if __name__ == "__main__":
    main()
