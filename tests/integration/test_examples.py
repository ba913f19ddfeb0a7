"""Every example in examples/ runs as-is against a real database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

EXPECT = {
    "exclusive_write.py": ["ran invoices for", "were already run"],
    "reindex_holder.py": ["reindexed chunk 3", "done; the lock is released"],
    "fenced_leader.py": ["leading with fence", "fenced writes so far"],
    "nightly_job.py": ["next run:", "manual run recorded as succeeded"],
    "sync_usage.py": ["psycopg: wrote under the lock", "SQLAlchemy:", "check_fence refused"],
    "tenant_schedules.py": ["example:digest:team-1: 0 10 * * 1 Europe/Paris, paused=False",
                            "example:digest:team-2: 0 9 * * 1 Europe/Paris, paused=True",
                            "digest for team 3", "manual run recorded as succeeded"],
}


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_example_runs(name: str, dsn: str) -> None:
    outputs = []
    # exclusive_write is run twice: the second run finds the work done.
    for _ in range(2 if name == "exclusive_write.py" else 1):
        result = subprocess.run([sys.executable, str(EXAMPLES / name), dsn],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    out = "\n".join(outputs)
    for line in EXPECT[name]:
        assert line in out, out
