"""The harness leaves nothing behind, even when the process that started it is
killed outright (a CI job's timeout, a SIGKILL): no Patroni, postgres or etcd
process, no temporary directory. Patroni, its postgres and etcd run in sessions of
their own (so that the events can signal them), so nothing else would end them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

STARTER = """
import sys, time
from tests.ha_patroni.patroni import PatroniCluster
cluster = PatroniCluster().start()
print(cluster.root, flush=True)
time.sleep(600)
"""


def processes_under(root: Path) -> list[str]:
    """Every process whose command line names ``root`` (Patroni's config, postgres's
    data directory, etcd's)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(root) in line]


def test_a_killed_test_process_leaves_no_cluster_behind() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert starter.stdout is not None
    root = Path(starter.stdout.readline().strip())
    assert root.name.startswith("pgcoord-patroni-"), root
    assert processes_under(root)  # the cluster runs
    starter.send_signal(signal.SIGKILL)  # no atexit, no finally
    starter.wait()
    deadline = time.monotonic() + 20
    while (processes_under(root) or root.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = processes_under(root)
    for line in left:  # the next tests must not meet them either
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, left
    assert not root.exists()
