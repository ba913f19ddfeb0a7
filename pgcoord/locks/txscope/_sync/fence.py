# Generated from pgcoord/locks/txscope/_async/fence.py by tools/generate_sync.py: do not edit.
"""A half of ``check_fence``: async connections in ``_async/`` (written by hand), sync
ones in ``_sync/`` (generated). It runs the check; ``pgcoord.leases.fence`` judges it."""

from __future__ import annotations

from typing import Any

from ...._core.queries import query
from ...._drivers import fetchval_on_sync


def fence_error_sync(conn: Any, name: str, fence: int) -> Exception | None:
    """Lock lease ``name``'s row ``FOR SHARE`` in ``conn``'s transaction, and check
    that ``fence`` is its current fence; the error the check raised, if any."""
    try:
        fetchval_on_sync(conn, query("lease_check_fence"), (name, fence))
    except Exception as exc:
        return exc
    return None
