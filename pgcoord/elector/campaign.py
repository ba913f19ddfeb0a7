"""The follower's side of an election: wait until this replica holds the lease, on its
own session (blocking on the doorbell) or on a member's (trying it, between news)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING

from .._core import errmap as _errmap
from .._core.queries import query

if TYPE_CHECKING:
    from .elector import Elector


class _SessionLost(Exception):
    """The elector's session is gone (internal: the elector connects again)."""


async def campaign(el: Elector) -> tuple[int, bool, float]:
    """Wait until this replica holds the lease: (fence, holds the doorbell, send time)."""
    assert el._conn is not None
    if el._member is not None:
        return await campaign_on_member(el)
    bell = el._bell
    assert bell is not None
    while True:
        rang = False
        if not el.polling:
            # A follower listens to nothing unless watched: the doorbell wakes it.
            await el._tune_news(leading=False)
            # Block on the leader's doorbell, looking at the lease at least
            # once a ttl in case a leader leads without one.
            wait = query("advisory_timeout").format(
                fn="pg_advisory_lock", key=el._doorbell, timeout_ms=el._ttl_ms)
            el._ringing = True
            try:
                await el._call_execute(wait)
                bell.rang()
                rang = True
            except Exception as exc:
                if _errmap.sqlstate(exc) == _errmap.SQLSTATE_QUERY_CANCELED:
                    # Cut for a watch(), or by an operator's pg_cancel_backend (a
                    # tool ending what looks like a long-waiting query): that one
                    # statement is cut, the session lives. Listen if watched, wait
                    # again. A cancel that came just as the lock was granted may
                    # have left it taken, unseen: a follower holds no level of its
                    # own doorbell while it waits, so every level is let go.
                    await el._call_execute(query("holder_undo").format(
                        key=el._doorbell, mode="ExclusiveLock", unlock_fn="pg_advisory_unlock"))
                    continue
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
                    raise
                # The leader may have gone just after the wait gave up: take
                # the bell now if it is free, so that a lease won here is
                # tied to this session (and a crash of ours is heard at once).
                rang = await bell.ring()
            finally:
                el._ringing = False
        sent = time.monotonic()
        fence = await el._call(query("lease_acquire"), el.name, el.holder, el._ttl_ms,
                                 el._conn.backend_pid if rang else None)
        if fence is not None:
            return int(fence), rang, sent
        if rang:  # the bell was free but someone leads without it: let it go
            await bell.unring()
        # After a doorbell wait that timed out, wait on it again at once: a
        # pause here would be a window in which a leader's death goes unheard.
        if el.polling or rang:
            await asyncio.sleep(el.ttl / 3 * random.uniform(0.8, 1.0))

async def campaign_on_member(el: Elector) -> tuple[int, bool, float]:
    """As ``_campaign``, on a shared session: try the bell, never wait on it;
    between tries wait for news (a member gone, the lease released or taken)
    or a third of a ttl.

    While another session holds the bell, a contender is mid-attempt or a
    leader lives: the lease is not asked for then, so that it is never taken
    unbound (with no session to tie it to) in a race with that contender.
    Only after a third of a ttl without news is it asked for without the
    bell, for a lease whose bell is held by a session that no longer renews
    it (the lease expires)."""
    conn, bell = el._conn, el._bell
    assert conn is not None and bell is not None and el._lost is not None
    quiet = False
    while True:
        el._news.clear()  # before looking, so news that comes meanwhile is kept
        rang = False
        if not el.polling:
            rang = await bell.ring()
        if quiet and not rang and not el.polling:
            # Between news, a lease whose bell another session holds can be taken
            # only once it has expired (a holder's death frees the bell; a release
            # or a resignation is news): a plain read says whether to ask. Asking
            # each time locked the lease's row and scanned pg_locks, once a third
            # of a ttl for every follower.
            quiet = bool(await el._call(query("lease_may_be_free"), el.name))
        if rang or el.polling or quiet:
            sent = time.monotonic()
            try:
                fence = await el._call(query("lease_acquire"), el.name, el.holder,
                                         el._ttl_ms, conn.backend_pid if rang else None)
            except Exception as exc:
                # The row is held FOR SHARE by a fenced transaction: busy, not
                # a reason to stall the member's session (lock_timeout on it).
                if _errmap.sqlstate(exc) != _errmap.SQLSTATE_LOCK_NOT_AVAILABLE:
                    raise
                fence = None
            if fence is not None:
                if not rang and not el.polling:
                    rang = await bell.bind(el.name, el.holder, int(fence))
                return int(fence), rang, sent
            if rang:
                await bell.unring()
        lost = asyncio.ensure_future(el._lost.wait())
        news = asyncio.ensure_future(el._news.wait())
        try:
            await asyncio.wait({lost, news}, timeout=el.ttl / 3 * random.uniform(0.8, 1.0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            news.cancel()
        if el._lost.is_set():
            raise _SessionLost("the member's session was lost")
        quiet = not el._news.is_set()
        if not quiet:
            # News: whoever held the bell is letting go of it (a contender
            # that lost, a leader resigning or gone): look again in a moment
            # rather than at the next news.
            await asyncio.sleep(random.uniform(0.002, 0.01))
