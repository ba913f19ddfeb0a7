"""Crash news in a large group, when a process takes several members with it.

    python bench/crash_news.py [--processes 20] [--per 10] [--rounds 5]

``--processes`` processes each open ``--per`` members of one group (ttl 30 s, so
that only the watcher ring can be quick) and watch the group. Each round SIGKILLs
one process, so that ``--per`` members die at once, often neighbours in the ring,
and takes, for every surviving member, the time from the kill to the last of the
dead members' ``MemberLeft`` it saw (wall clocks of one host). A replacement
process then joins, and the next round starts once every member has seen it.

Prints p50/p99/max over every survivor of every round, and the time a plain lock
wait on one of the killed sessions took to be granted (the server's own floor).
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


async def process(dsn: str, group: str, prefix: str, per: int) -> None:
    import pgcoord

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    members = [pgcoord.Member(dsn, group=group, name=f"{prefix}/{i}", ttl=30) for i in range(per)]
    await asyncio.gather(*(m.open() for m in members))
    watches = [m.watch() for m in members]
    # Ready once every member hears news and the process's listening session is in
    # place (a watch() starts listening in the background): a death before that is
    # not this benchmark's business.
    while not (all(m._hears_news for m in members)
               and any("pgcoord_members" in m._listening for m in members)):
        await asyncio.sleep(0.01)
    pids = ",".join(str(m._main.backend_pid) for m in members if m._main is not None)
    print(f"JOINED {pids}", flush=True)

    async def report(i: int) -> None:
        async for change in watches[i]:
            kind = "LEFT" if isinstance(change, pgcoord.MemberLeft) else "JOINED-PEER"
            # Timed when seen, written out in batches (below): a write and a wake-up of
            # the harness for each of 1,900 lines a round competed with the very
            # deliveries being timed.
            print(f"{kind} {i} {change.member.name} {time.time():.6f}")

    async def flush() -> None:
        while True:
            await asyncio.sleep(0.2)
            sys.stdout.flush()

    reporters = [asyncio.create_task(report(i)) for i in range(per)]
    reporters.append(asyncio.create_task(flush()))
    await stop.wait()
    for task in reporters:
        task.cancel()
    await asyncio.gather(*(m.close() for m in members), return_exceptions=True)


class Proc:
    def __init__(self, dsn: str, group: str, per: int) -> None:
        self.prefix = f"p{uuid.uuid4().hex[:6]}"
        self.per = per
        self.lines: list[str] = []
        # (kind, prefix of the member seen) -> our member's index -> times: parsed as
        # lines come, so that waiting for a round to end costs the harness (on the
        # cores the survivors share) next to nothing; re-reading every line at each
        # look took a good part of a core while the news was being delivered.
        self.events: dict[tuple[str, str], dict[int, list[float]]] = {}
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--process", dsn, group,
                                      self.prefix, str(per)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            self.lines.append(line)
            parts = line.split()
            if len(parts) == 4 and parts[0] in ("LEFT", "JOINED-PEER"):
                seen = self.events.setdefault((parts[0], parts[2].split("/")[0]), {})
                seen.setdefault(int(parts[1]), []).append(float(parts[3]))

    def pids(self) -> list[int] | None:
        for line in list(self.lines):
            if line.startswith("JOINED "):
                return [int(x) for x in line.split()[1].split(",")]
        return None

    def seen(self, kind: str, prefix: str) -> dict[int, list[float]]:
        """For each of our members, the times it saw `kind` of members of `prefix`."""
        return {i: list(times) for i, times in self.events.get((kind, prefix), {}).items()}


def wait_until(check: object, timeout: float, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(every)
    return False


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def lock_floor(dsn: str) -> float:
    """How long a plain session lock wait on a SIGKILLed process's session takes to be granted."""
    import psycopg

    holder = subprocess.Popen([sys.executable, "-c",
                               "import psycopg,sys,time; c=psycopg.connect(sys.argv[1], autocommit=True); "
                               "c.execute('select pg_advisory_lock(4242)'); print('HELD', flush=True); "
                               "time.sleep(600)", dsn], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    holder.stdout.readline()
    waiter = psycopg.connect(dsn, autocommit=True)
    result: list[float] = []

    def wait() -> None:
        waiter.execute("select pg_advisory_lock(4242)")
        result.append(time.time())

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)
    killed = time.time()
    holder.send_signal(signal.SIGKILL)
    thread.join(10)
    waiter.close()
    holder.wait()
    return result[0] - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=20)
    parser.add_argument("--per", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from bench._server import bench_database

    # Two sessions a member, and room for the harness.
    connections = str(max(300, 2 * args.processes * args.per + 50))
    with bench_database({"max_connections": connections}) as (dsn, _server):
        group = f"crash-{uuid.uuid4().hex[:6]}"
        procs = [Proc(dsn, group, args.per) for _ in range(args.processes)]
        total = args.processes * args.per
        assert wait_until(lambda: all(p.pids() for p in procs), 120), "members did not join"
        time.sleep(2.0)
        samples: list[float] = []
        try:
            for _ in range(args.rounds):
                victim = procs.pop(len(procs) // 2)
                assert wait_until(lambda: all(p.pids() for p in procs), 60), "not every process listens"
                survivors = list(procs)
                killed = time.time()
                victim.proc.send_signal(signal.SIGKILL)

                def all_told() -> bool:
                    return all(len(s.seen("LEFT", victim.prefix)) == s.per
                               and all(len(v) >= victim.per for v in s.seen("LEFT", victim.prefix).values())
                               for s in survivors)

                # Looked at seldom: the harness shares the cores the survivors use.
                told = wait_until(all_told, 30, every=0.25)
                for s in survivors:
                    for times in s.seen("LEFT", victim.prefix).values():
                        samples.append(max(sorted(times)[:victim.per]) - killed)
                if not told:
                    print("| (a round timed out: not every survivor saw every death) |", flush=True)
                    for s in survivors:
                        seen = s.seen("LEFT", victim.prefix)
                        short = {i: len(v) for i, v in seen.items() if len(v) < victim.per}
                        if len(seen) < s.per or short:
                            print(f"|   {s.prefix} (round {len(samples)}): {len(seen)} of {s.per} members saw deaths; "
                                  f"short: {short} |", flush=True)
                victim.proc.wait()
                replacement = Proc(dsn, group, args.per)
                procs.append(replacement)
                assert wait_until(lambda: all(
                    len(s.seen("JOINED-PEER", replacement.prefix)) == s.per for s in survivors), 60)
                time.sleep(1.0)
            floor = lock_floor(dsn)
        finally:
            for p in procs:
                p.proc.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.proc.wait(30)
                except subprocess.TimeoutExpired:
                    p.proc.kill()
        ms = [x * 1000 for x in samples]
        # The first survivor to know every death: the reap and its NOTIFY; the rest of
        # the spread is the survivors' own processes waking on a shared machine.
        print("| members | dying at once | samples | first | p50 | p99 | max | a plain lock wait's grant |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {total} | {args.per} | {len(ms)} | {min(ms):.1f} ms | {percentile(ms, 50):.1f} ms | "
              f"{percentile(ms, 99):.1f} ms | {max(ms):.1f} ms | {floor * 1000:.1f} ms |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--process":
        asyncio.run(process(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    else:
        main()
