"""The NOTIFY tax: what pgcoord's listeners cost an application's own NOTIFY traffic.

    python bench/notify_tax.py [--members 100] [--processes 5] [--seconds 5] [--listeners 0,5,20,100] [--rounds 8]

Before PostgreSQL 19, a NOTIFY's commit signals every session that LISTENs in the
database, whatever the channel. So an application that NOTIFYs (a job queue, a
cache bus) commits more slowly the more sessions listen. This measures the
application's commit rate of ``SELECT pg_notify('app_events', ...)`` (4
connections, autocommit, each statement its own commit) for ``--seconds``:

- with nothing else connected (the baseline, measured before and after each case,
  so that a ratio compares two runs a few seconds apart on a shared machine);
- with N plain connections LISTENing on an unrelated channel (the reference);
- with ``--members`` pgcoord members in ``--processes`` processes, each member
  running what a service runs: an Elector, a held ``LockHolder`` lock and a
  ``Scheduler`` with a member (no Partitions, no ``watch()``).

Each row gives the rate and its ratio to the mean of the baselines around it, and
how many sessions LISTEN while the case runs (each member process counts its own:
no catalog view shows another session's channels).

A second table compares the members running with the same members stopped
(SIGSTOP), in ``--rounds`` alternating rounds: each ratio has a baseline measured
seconds away, and the median over rounds stands against a shared machine's drift.
Stopped members keep their sessions open (idle, listening to nothing), so this
isolates what the members' work costs from what their connections cost.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

APP_CONNECTIONS = 4


# -- a process of members ---------------------------------------------------------------------

async def members_process(dsn: str, prefix: str, n: int) -> None:
    import asyncpg

    import pgcoord

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    members = [pgcoord.Member(dsn, group=f"{prefix}:tax", name=f"{prefix}:{i}", ttl=10) for i in range(n)]
    tasks: list[asyncio.Task[None]] = []
    held = contextlib.AsyncExitStack()
    try:
        await asyncio.gather(*(m.open() for m in members))
        for i, member in enumerate(members):
            elector = pgcoord.Elector(member, f"{prefix}:leader:{i % 4}", ttl=10)

            async def lead(fence: int) -> None:
                await asyncio.sleep(3600)

            tasks.append(asyncio.create_task(elector.run(lead)))
            holder = await held.enter_async_context(pgcoord.LockHolder(member))
            await held.enter_async_context(holder.lock(f"{prefix}:lock:{i}"))
            sched = pgcoord.Scheduler(pool, member=member)

            @sched.cron(f"{prefix}:job:{i % 4}", "* * * * *")
            async def job() -> None:
                pass

            tasks.append(asyncio.create_task(sched.run()))
        await asyncio.sleep(4.0)  # past the first heartbeat (ttl/3)
        # Which member sessions LISTEN (another session's channels are not visible
        # in any catalog view, so each process says what its members listen to).
        print(f"READY {sum(1 for m in members if m._listening)}", flush=True)
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await held.aclose()
        await asyncio.gather(*(m.close() for m in members), return_exceptions=True)
        await pool.close()


# -- the harness --------------------------------------------------------------------------------

def start_members(dsn: str, members: int, processes: int) -> tuple[list[subprocess.Popen[str]], int]:
    per = members // processes
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--members-process", dsn,
                               f"p{k}-{uuid.uuid4().hex[:4]}", str(per)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for k in range(processes)]
    ready = threading.Barrier(processes + 1)
    listening: list[int] = []

    def wait_ready(proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                listening.append(int(line.split()[1]))
                break
        ready.wait()

    for proc in procs:
        threading.Thread(target=wait_ready, args=(proc,), daemon=True).start()
    ready.wait(timeout=120)
    time.sleep(2.0)  # the members' first ticks and campaigns settle
    return procs, sum(listening)


def stop_members(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


NOTIFY = "SELECT pg_notify('app_events', 'x')"
# The control: a commit that writes as much (an xid), without a NOTIFY. Its ratio
# shows what the members cost the machine (2 cores shared by everything here), so
# that the NOTIFY ratio can be read beside it.
PLAIN = "SELECT pg_catalog.pg_current_xact_id()"


async def commit_rate(dsn: str, seconds: float, statement: str = NOTIFY) -> float:
    import asyncpg

    conns = [await asyncpg.connect(dsn) for _ in range(APP_CONNECTIONS)]
    count = 0
    deadline = time.monotonic() + seconds

    async def worker(conn: asyncpg.Connection) -> None:
        nonlocal count
        while time.monotonic() < deadline:
            await conn.execute(statement)
            count += 1

    start = time.monotonic()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.monotonic() - start
    for conn in conns:
        await conn.close()
    return count / elapsed


async def with_plain_listeners(dsn: str, n: int, seconds: float) -> tuple[float, int]:
    import asyncpg

    conns = [await asyncpg.connect(dsn, server_settings={"application_name": "bench-listener"})
             for _ in range(n)]
    for conn in conns:
        await conn.add_listener("unrelated", lambda *_: None)
    try:
        return await commit_rate(dsn, seconds), n
    finally:
        for conn in conns:
            await conn.close()


def alternating(dsn: str, procs: list[subprocess.Popen[str]], rounds: int, seconds: float,
                statement: str) -> list[float]:
    """Per round, the rate beside the running members over the rate beside the same
    members stopped (SIGSTOP: their sessions stay, idle, and none listens). Rounds a few
    seconds apart, each its own baseline: on a shared machine, a baseline taken a
    minute away moved the ratio more than the members did."""
    ratios = []
    for _ in range(rounds):
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        stopped = asyncio.run(commit_rate(dsn, seconds, statement))
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.5)
        running = asyncio.run(commit_rate(dsn, seconds, statement))
        ratios.append(running / stopped)
    return ratios


def spread(ratios: list[float]) -> str:
    """The median ratio and the middle half of the rounds."""
    ordered = sorted(ratios)
    n = len(ordered)
    return (f"{ordered[n // 2]:.2f} | {ordered[n // 4]:.2f}–{ordered[(3 * n) // 4 - (1 if n % 4 == 0 else 0)]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=100)
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--listeners", default="5,20,100")
    parser.add_argument("--rounds", type=int, default=8,
                        help="rounds of members stopped / running (the second table)")
    args = parser.parse_args()
    from bench._server import bench_database

    with bench_database() as (dsn, _server):
        asyncio.run(commit_rate(dsn, 1.0))  # warm up
        print("| case | listening sessions | NOTIFY commits/s | ratio to no listeners |")
        print("|---|---:|---:|---:|")

        def row(label: str, rate: float, listening: int, base: float) -> None:
            print(f"| {label} | {listening} | {rate:,.0f} | {rate / base:.2f} |", flush=True)

        before = asyncio.run(commit_rate(dsn, args.seconds))
        print(f"| nothing else connected | 0 | {before:,.0f} | 1.00 |", flush=True)
        for n in (int(x) for x in args.listeners.split(",") if x):
            rate, listening = asyncio.run(with_plain_listeners(dsn, n, args.seconds))
            after = asyncio.run(commit_rate(dsn, args.seconds))
            row(f"{n} plain listeners (reference)", rate, listening, (before + after) / 2)
            before = after
        plain_before = asyncio.run(commit_rate(dsn, args.seconds, PLAIN))
        procs, listening = start_members(dsn, args.members, args.processes)
        try:
            rate = asyncio.run(commit_rate(dsn, args.seconds))
            plain = asyncio.run(commit_rate(dsn, args.seconds, PLAIN))
            short = max(1.0, args.seconds / 2)
            notify_ratios = alternating(dsn, procs, args.rounds, short, NOTIFY)
            plain_ratios = alternating(dsn, procs, args.rounds, short, PLAIN)
        finally:
            stop_members(procs)
        time.sleep(1.0)
        after = asyncio.run(commit_rate(dsn, args.seconds))
        plain_after = asyncio.run(commit_rate(dsn, args.seconds, PLAIN))
        row(f"{args.members} members (elector, lock, scheduler)", rate, listening, (before + after) / 2)
        print(f"| control: the same commits without NOTIFY, beside the {args.members} members | "
              f"{listening} | {plain:,.0f} | {plain / ((plain_before + plain_after) / 2):.2f} |")
        print()
        print(f"The same {args.members} members running against stopped (SIGSTOP), {args.rounds} rounds"
              f" of {max(1.0, args.seconds / 2):.1f} s each way:")
        print()
        print("| application's commits | running / stopped (median) | middle half of rounds |")
        print("|---|---:|---:|")
        print(f"| NOTIFY | {spread(notify_ratios)} |")
        print(f"| control: without NOTIFY | {spread(plain_ratios)} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--members-process":
        asyncio.run(members_process(sys.argv[2], sys.argv[3], int(sys.argv[4])))
    else:
        main()
