"""Membership: how fast a death is news, and what a member costs in connections.

    python bench/members.py [--rounds 15] [--sizes 5,20] [--failovers 10]

Crash news: N member processes in one group (ttl 10 s, so that nothing but the
watcher ring can be what told them). Each round SIGKILLs one member, or ends its
session with ``pg_terminate_backend``, and measures, for every survivor, the
time from the event to the survivor's ``MemberLeft`` (wall clocks of one host);
then a replacement joins and the next round starts once everyone has seen it.

Failover of 20 electors: two processes each run 20 electors (ttl 30 s); the
first leads all 20; it is SIGKILLed and the time to each lease's new leader is
taken, for electors on a Member and, as the baseline in the same run, electors
with a session each (the doorbell design of docs/leases.md).

Connections: what one process holds open for 20 electors and a LockHolder with
200 locks, with a Member and without.
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


async def elector_replica(dsn: str, prefix: str, n: int, mode: str) -> None:
    import pgcoord

    def lead_for(i: int) -> object:
        async def lead(fence: int) -> None:
            print(f"LEAD {i} {time.time():.6f}", flush=True)
            await asyncio.sleep(3600)
        return lead

    if mode == "member":
        async with pgcoord.Member(dsn, group=f"{prefix}:g", ttl=30) as member:
            electors = [pgcoord.Elector(member, f"{prefix}:{i}", ttl=30) for i in range(n)]
            print("READY", flush=True)
            await asyncio.gather(*(e.run(lead_for(i)) for i, e in enumerate(electors)))  # type: ignore[arg-type]
    else:
        electors = [pgcoord.Elector(dsn, f"{prefix}:{i}", ttl=30) for i in range(n)]
        print("READY", flush=True)
        await asyncio.gather(*(e.run(lead_for(i)) for i, e in enumerate(electors)))  # type: ignore[arg-type]


# -- the harness -------------------------------------------------------------------------------

class Proc:
    def __init__(self, dsn: str, group: str, name: str, ttl: float, *args: str) -> None:
        self.name = name
        self.lines: list[str] = []
        command = args or ("--replica", dsn, group, name, str(ttl))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *command],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def failover(dsn: str, rounds: int, mode: str, n: int = 20) -> list[float]:
    prefix = f"bench-fo-{mode}-{uuid.uuid4().hex[:6]}"

    def start() -> Proc:
        proc = Proc(dsn, "", mode, 0, "--elector-replica", dsn, prefix, str(n), mode)
        if not wait_until(lambda: "READY" in proc.lines, 30):
            raise RuntimeError("elector replica did not start")
        return proc

    def leads(proc: Proc) -> list[float]:
        """When each lease was first led by ``proc``."""
        first: dict[str, float] = {}
        for x in list(proc.lines):
            if x.startswith("LEAD "):
                _, i, at = x.split()
                first.setdefault(i, float(at))
        return list(first.values())

    leader = start()
    if not wait_until(lambda: len(leads(leader)) == n, 30):
        raise RuntimeError("the first replica did not lead every lease")
    took: list[float] = []
    try:
        for _ in range(rounds):
            follower = start()
            time.sleep(0.5)  # campaigning: waiting on the bells, or for news
            at = time.time()
            leader.proc.kill()
            leader.proc.wait()
            if not wait_until(lambda f=follower: len(leads(f)) == n, 15):
                import psycopg

                with psycopg.connect(dsn, autocommit=True) as c:
                    for row in c.execute("select name, holder, fence, holder_pid, expires_at > now(),"
                                         " pgcoord.lease_session_alive(name, holder_pid) from pgcoord.leases"
                                         " where name like %s order by name", (prefix + "%",)):
                        print("LEASE", row)
                    print("F lines", follower.lines)
                raise RuntimeError(f"not every lease found a new leader: {sorted(follower.lines)}")
            took += [t - at for t in leads(follower)]
            leader = follower
    finally:
        leader.proc.kill()
        leader.proc.wait()
    return took


def connections_per_process(dsn: str) -> tuple[int, int]:
    """Server connections one process holds for 20 electors and a LockHolder with
    200 locks: each with a session of its own, then all on one Member."""
    import pgcoord

    async def measure(with_member: bool) -> int:
        import psycopg

        app = f"bench-conn-{uuid.uuid4().hex[:6]}"
        member = pgcoord.Member(dsn, group=app, application_name=app) if with_member else None
        if member is not None:
            await member.open()
        electors = [pgcoord.Elector(member if member is not None else dsn, f"{app}:{i}", ttl=10,
                                    **({} if member is not None else {"application_name": app}))
                    for i in range(20)]
        led: set[int] = set()

        def lead_for(i: int) -> object:
            async def lead(fence: int) -> None:
                led.add(i)
                await asyncio.sleep(3600)
            return lead

        tasks = [asyncio.create_task(e.run(lead_for(i))) for i, e in enumerate(electors)]  # type: ignore[arg-type]
        holder = pgcoord.LockHolder(member if member is not None else dsn,
                                    **({} if member is not None else {"application_name": app}))
        await holder.open()
        locks = [holder.lock(f"{app}:lock{i}") for i in range(200)]
        for lock in locks:
            await lock.__aenter__()
        wait_until(lambda: len(led) == 20, 20)
        while len(led) < 20:
            await asyncio.sleep(0.05)
        with psycopg.connect(dsn, autocommit=True) as c:
            count = c.execute("select count(*) from pg_stat_activity where application_name like %s",
                              (app + "%",)).fetchone()[0]  # type: ignore[index]
        for lock in reversed(locks):
            await lock.__aexit__(None, None, None)
        await holder.close()
        for e in electors:
            await e.stop()
        for t in tasks:
            await t
        if member is not None:
            await member.close()
        return int(count)

    return asyncio.run(measure(False)), asyncio.run(measure(True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="5,20")
    parser.add_argument("--failovers", type=int, default=10)
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
        print()
        print("| 20 electors, leader SIGKILLed | samples | p50 | p99 | max |")
        print("|---|---:|---:|---:|---:|")
        for mode, label in (("member", "on one Member"), ("dsn", "a session each (baseline)")):
            ms = [x * 1000 for x in failover(dsn, args.failovers, mode)]
            print(f"| {label} | {len(ms)} | {percentile(ms, 50):.1f} ms | {percentile(ms, 99):.1f} ms | "
                  f"{max(ms):.1f} ms |", flush=True)
        print()
        own, shared = connections_per_process(dsn)
        print("| one process: 20 electors + a LockHolder with 200 locks | server connections |")
        print("|---|---:|")
        print(f"| a session each (DSN forms) | {own} |")
        print(f"| one Member | {shared} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        asyncio.run(replica(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--elector-replica":
        asyncio.run(elector_replica(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
    else:
        main()
