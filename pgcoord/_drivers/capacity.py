"""How many connections a pool or engine can lend at once, for features that
need one beside what the caller holds (lease renewals, job heartbeats)."""

from __future__ import annotations

from typing import Any


def pool_capacity(source: Any) -> int | None:
    """The most connections ``source`` (a pool or engine) can have out at once, or
    None when it sets no bound that pgcoord can read."""
    module = type(source).__module__.partition(".")[0]
    if module == "asyncpg":
        return int(source.get_max_size())
    if module == "psycopg_pool":
        return int(source.max_size) or None  # 0: an AsyncNullConnectionPool without a bound
    if module == "sqlalchemy":
        from sqlalchemy.pool import AssertionPool, QueuePool, SingletonThreadPool, StaticPool

        pool = getattr(source, "sync_engine", source).pool
        if isinstance(pool, StaticPool | AssertionPool | SingletonThreadPool):
            return 1
        if isinstance(pool, QueuePool):
            # QueuePool keeps max_overflow only in this private attribute (-1:
            # unbounded, also for pool_size=0); test_pool_capacity_of_each_pool_type
            # fails if a SQLAlchemy version keeps it elsewhere. Unknown: no bound.
            overflow = getattr(pool, "_max_overflow", None)
            if isinstance(overflow, int) and overflow >= 0:
                return int(pool.size()) + overflow
    return None
