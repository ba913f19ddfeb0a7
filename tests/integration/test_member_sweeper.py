"""The group's sweep, the fallback for a death whose watcher was paused itself, with
members of different ttls in one group: real member processes, SIGSTOP and SIGKILL
(only the lowest fresh member sweeps since 0011; fresh is judged on the shorter ttl)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .test_member import REPLICA, Fleet, group


class MixedFleet(Fleet):
    def __init__(self, dsn: str, ttls: list[float], driver: str = "asyncpg") -> None:
        self.dsn, self.driver, self.group = dsn, driver, group()
        self.procs, self.lines, self.ttls = {}, {}, {}
        for i, ttl in enumerate(ttls):  # one at a time: ids in this order
            name = f"m{i}"
            self.ttls[name] = ttl
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
            proc = subprocess.Popen([sys.executable, REPLICA, dsn, self.group, name, str(ttl), driver],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            lines: list[str] = []
            self.procs[name], self.lines[name] = proc, lines
            threading.Thread(target=lambda p=proc, out=lines: [out.append(x.strip()) for x in p.stdout],  # type: ignore[union-attr]
                             daemon=True).start()
            self.wait_for(lambda lines=lines: any(x.startswith("JOINED ") for x in lines))
        time.sleep(0.5)

    def ids(self) -> dict[str, int]:
        return {n: int(next(x for x in self.lines[n] if x.startswith("JOINED ")).split()[1]) for n in self.procs}


@pytest.mark.parametrize("ttls,paused,victim", [
    # all ttl 3: lowest (sweeper) paused, and the victim's watcher paused too
    ([3.0, 3.0, 3.0, 3.0, 3.0], ["m0", "m1"], "m2"),
    # a long-ttl sweeper and a long-ttl paused watcher; the victim and the others ttl 3
    ([30.0, 30.0, 3.0, 3.0, 3.0], ["m1"], "m2"),
])
def test_death_with_paused_watcher_told_within_the_victims_ttl(
        dsn: str, ttls: list[float], paused: list[str], victim: str) -> None:
    fleet = MixedFleet(dsn, ttls)
    try:
        ids = fleet.ids()
        assert sorted(ids, key=ids.__getitem__) == list(fleet.procs)
        for p in paused:
            fleet.procs[p].send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        killed = time.time()
        fleet.procs[victim].kill()
        others = [n for n in fleet.procs if n not in paused and n != victim]
        fleet.wait_for(lambda: all(fleet.left_seen(o, victim) for o in others), timeout=25)
        took = {o: round(fleet.left_seen(o, victim)[1] - killed, 2) for o in others}  # type: ignore[index]
        # Before 0011 every member's beat swept: told within ttl/3 of the victim's peers.
        assert max(took.values()) < fleet.ttls[victim], took
    finally:
        for p in paused:
            fleet.procs[p].send_signal(signal.SIGCONT)
        fleet.stop()
