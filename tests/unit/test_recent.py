"""The bounded set behind "once per process and name" (pgcoord/_core/recent.py)."""

from __future__ import annotations

import threading

import pytest

from pgcoord._core.recent import RecentSet


def test_the_least_recently_used_key_is_forgotten_first() -> None:
    seen: RecentSet[int] = RecentSet(3)
    for key in (1, 2, 3):
        seen.add(key)
    assert 1 in seen  # a look-up counts as a use: 2 is now the oldest
    seen.add(4)
    assert [k for k in (1, 2, 3, 4) if k in seen] == [1, 3, 4]
    assert len(seen) == 3


def test_threads_adding_at_once_never_pass_the_bound() -> None:
    seen: RecentSet[int] = RecentSet(50)

    def add(start: int) -> None:
        for key in range(start, start + 5_000):
            seen.add(key)
            assert len(seen) <= 50

    threads = [threading.Thread(target=add, args=(n * 10_000,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 50


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        RecentSet(0)
