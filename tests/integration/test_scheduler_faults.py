"""Scheduler with real processes: 4 replicas, a per-second job, random SIGKILLs."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest

REPLICA = str(Path(__file__).with_name("scheduler_replica.py"))


class Replicas:
    def __init__(self, dsn: str, mode: str) -> None:
        self.dsn, self.mode = dsn, mode
        self.job = f"faults:{mode}:{uuid.uuid4().hex[:6]}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("create table if not exists job_starts (id serial primary key, job text,"
                         " slot_at timestamptz, attempt int, runner text)")
            conn.execute("create table if not exists job_effects (job text, slot_at timestamptz,"
                         " primary key (job, slot_at))")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.count = 0

    def spawn(self) -> None:
        self.count += 1
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.procs.append(subprocess.Popen(
            [sys.executable, REPLICA, self.dsn, self.job, self.mode, f"r{self.count}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(sql, params or None).fetchall()

    def running_runners(self) -> set[str]:
        return {str(r) for (r,) in self.query(
            "select runner from pgcoord.job_slots where job = %s and state = 'running'", self.job)}

    def wait_for_first_slot(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query("select 1 from pgcoord.job_slots where job = %s limit 1", self.job):
                return
            time.sleep(0.05)
        raise AssertionError("the replicas never started a slot")

    def chaos(self, seconds: float, rng: random.Random,
              pause: tuple[float, float] = (0.6, 1.4)) -> int:
        """Kill a replica that is running a slot, now and then; respawn it. The clock
        starts with the first slot, so slow process start-up does not eat the window."""
        self.wait_for_first_slot()
        kills = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(*pause))
            # Wait (briefly) for a replica that is in the middle of a slot.
            for _ in range(20):
                busy = self.running_runners()
                victims = [i for i, p in enumerate(self.procs)
                           if p.poll() is None and f"r{i + 1}" in busy]
                if victims:
                    self.procs[rng.choice(victims)].kill()
                    kills += 1
                    self.spawn()
                    break
                time.sleep(0.05)
        return kills

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()

    def settle(self, seconds: float) -> None:
        """One fresh replica sweeps up the claims of the killed ones, then stops."""
        self.spawn()
        time.sleep(seconds)
        self.stop()

    def run_with_kills(self, replicas: int, seconds: float, seed: int, settle: float,
                       pause: tuple[float, float] = (0.6, 1.4)) -> int:
        """Start the replicas, kill busy ones at random for ``seconds``, stop them all,
        then let one fresh replica sweep up; the number of kills."""
        for _ in range(replicas):
            self.spawn()
        try:
            kills = self.chaos(seconds, random.Random(seed), pause)
            self.stop()
            self.settle(settle)
        finally:
            for p in self.procs:
                p.kill()
        return kills

    def assert_every_slot_accounted_for(self) -> list[tuple[object, ...]]:
        rows = self.query("select slot_at, state, extract(epoch from slot_at)::bigint"
                          " from pgcoord.job_slots where job = %s and not manual order by slot_at",
                          self.job)
        assert rows, "no slot ran at all"
        seconds = [int(s) for _, _, s in rows]  # type: ignore[call-overload]
        assert seconds == list(range(seconds[0], seconds[-1] + 1)), "a slot has no row"
        states = {str(s) for _, s, _ in rows}
        assert states <= {"succeeded", "abandoned", "failed", "missed", "skipped"}, states
        return rows


@pytest.mark.parametrize("mode", ["skip"])
def test_each_slot_starts_at_most_once_under_random_sigkills(dsn: str, mode: str) -> None:
    fleet = Replicas(dsn, mode)
    kills = fleet.run_with_kills(replicas=4, seconds=11, seed=11, settle=2.5)
    assert kills >= 3
    rows = fleet.assert_every_slot_accounted_for()
    assert len(rows) >= 10
    starts = fleet.query("select slot_at, count(*) from job_starts where job = %s group by slot_at"
                         " having count(*) > 1", fleet.job)
    assert starts == [], "a slot was started twice"
    abandoned = [r for r in rows if r[1] == "abandoned"]
    assert abandoned, "the kills should have abandoned some slots"


def test_retry_finishes_a_killed_slot_once(dsn: str) -> None:
    fleet = Replicas(dsn, "retry")
    # Kills far enough apart that a retry (claim_ttl 1 s, then 0.4 s of work) can finish.
    kills = fleet.run_with_kills(replicas=2, seconds=8, seed=5, settle=3.0, pause=(2.5, 3.0))
    assert kills >= 1
    fleet.assert_every_slot_accounted_for()
    retried = fleet.query("select slot_at, state, attempt, reason from pgcoord.job_slots"
                          " where job = %s and attempt > 1", fleet.job)
    assert any(state == "succeeded" for _, state, _, _ in retried), retried
    # A retry can itself be killed; only after max_attempts (5) is a slot given up.
    for _, state, attempt, reason in retried:
        assert state == "succeeded" or (
            state == "abandoned" and attempt == 5 and reason == "runner lost; attempts used up"
        ), retried


def test_transactional_effects_happen_exactly_once_under_kills(dsn: str) -> None:
    fleet = Replicas(dsn, "transactional")
    kills = fleet.run_with_kills(replicas=3, seconds=8, seed=3, settle=3.0, pause=(2.0, 2.5))
    assert kills >= 1
    fleet.assert_every_slot_accounted_for()
    succeeded = {r[0] for r in fleet.query(
        "select slot_at from pgcoord.job_slots where job = %s and state = 'succeeded'", fleet.job)}
    effects = [r[0] for r in fleet.query("select slot_at from job_effects where job = %s", fleet.job)]
    assert sorted(effects) == sorted(succeeded)  # one effect per succeeded slot, none otherwise
    restarted = fleet.query("select count(distinct slot_at) from job_starts where job = %s"
                            " and attempt > 1", fleet.job)
    assert restarted[0][0] >= 1  # a killed run was redone, and its effect still counted once
