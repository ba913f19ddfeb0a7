"""Asking a leader to step down from anywhere (``request_resign``), and the news of
a change of leader (``LeaderChanged``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._core import errmap as _errmap
from .._core.aio import finish_despite_cancel
from .._core.queries import query
from .._drivers.dedicated import DsnSource
from ..leases.statements import validate_name


@dataclass(frozen=True)
class LeaderChanged:
    """A change of leader seen by ``Elector.watch()``: the new holder (None when
    the lease was released) and the fence of the term."""

    holder: str | None
    fence: int


async def request_resign(source: Any, name: str) -> bool:
    """Ask the current leader of ``name`` to step down gracefully (for deploys).
    ``source``: a DSN, a ``Member``, or any async pool or engine pgcoord accepts.
    True when there was a live leader to ask; it resigns at once if it listens
    (it has a session), else at its next renewal."""
    name = validate_name(name)
    from ..member import Member

    # After the request has committed, the leader (and followers on members, which
    # listen to nothing) are poked: a leader on a member reads the request at the
    # renewal the poke brings forward.
    if isinstance(source, Member):
        await source.wait_joined()
        asked = bool(await source._call(query("lease_request_resign"), name))
        if asked:
            await source._call(query("lease_poke"), name)
        return asked
    if isinstance(source, str):
        conn = await DsnSource(source, None, keepalive=10.0).open()
        try:
            with _errmap.schema_missing_raised():
                asked = bool(await conn.fetchval(query("lease_request_resign"), name))
                if asked:
                    await conn.fetchval(query("lease_poke"), name)
                return asked
        finally:
            await finish_despite_cancel(conn.give_back())
    from .._drivers import check_source, run_statement

    check_source(source, need_async=True)
    row = await run_statement(source, query("lease_request_resign"), (name,))
    asked = bool(row and row[0])
    if asked:
        await run_statement(source, query("lease_poke"), (name,))
    return asked
