"""A database that takes no writes, as an ordinary state: said once, not once a retry.

A primary that its HA manager demoted (Patroni without its DCS restarts it as a
standby until it is promoted again), a standby, or ``default_transaction_read_only``:
every background loop of pgcoord (elector campaigns, lease renewals, scheduler
ticks, a member joining again) fails and backs off, each retry for as long as the
state lasts. That is expected and needs one line in the logs, not one per retry per
loop: the first loop to meet it logs a warning, the others log their retries at DEBUG,
and the first success after it logs that writes are accepted again, with how long
the state lasted. The notice is per process: an operator reads one process's log.

Writes can be refused to some of a process's connections and not to others: an
``ALTER DATABASE ... SET default_transaction_read_only = on`` reaches a pool's new
connections, while pgcoord's own sessions set it off for themselves. Then one loop
(an elector renewing on its session) keeps writing while another (a scheduler on
the pool) keeps failing, and "writes again" on the first loop's success would be
followed by "no writes" on the second loop's next retry: a pair of warnings a
second. So a loop that retries says who it is (``key``), and writes are said to be
accepted again only once no loop that met the state is still meeting it: each has
written since, or has not retried for ``FORGET`` seconds (it stopped, or lost what
it retried for). A failure with no key (a one-shot: a release given up, a
scheduler chore; an elector's campaign, which on a follower succeeds without ever
returning; a holding's renewal, which ends on many paths without a last success: the
key of either would never be cleared) starts the notice; for
``ONCE_GRACE`` seconds after it, only a loop that met the state itself can say
writes are accepted again (another loop's success, on a session of its own, proves
nothing about the connection that failed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from . import errmap

log = logging.getLogger("pgcoord")

_since: float | None = None  # monotonic time the state was first met, while it lasts
_failing: dict[str, float] = {}  # key of a loop meeting the state -> monotonic time it last did
_once_at = -1e9  # monotonic time of the last failure with no key

# A loop that met the state and neither retried nor wrote for this long is not
# waited for (every loop's backoff retries well within it).
FORGET = 60.0
ONCE_GRACE = 10.0
# The loops of several event loops (a sync twin's portal thread beside the
# application's own) share the notice.
_lock = threading.Lock()


def retrying(logger: logging.Logger, exc: BaseException, message: str, *args: Any,
             key: str | None = None) -> None:
    """Log a background failure after ``exc`` (a loop's retry, a release given up
    to expiry): as before (a warning) unless the database takes no writes; then the
    notice, once per process until it does again, and this at DEBUG. ``key`` names
    the loop, which then says ``writable(key)`` when it writes again."""
    global _since, _once_at
    if not errmap.read_only(exc):
        logger.warning(message, *args)
        return
    with _lock:
        if key is not None:
            _failing[key] = time.monotonic()
        else:
            _once_at = time.monotonic()
        first = _since is None
        if first:
            _since = time.monotonic()
    if first:
        log.warning("the database takes no writes now (%r): a primary demoted to read-only (an HA "
                    "manager such as Patroni, which demotes the primary when it loses its DCS), a "
                    "standby, or default_transaction_read_only. pgcoord backs off and tries again "
                    "until a primary takes writes; this is said once, not once per retry", exc)
    logger.debug(message, *args)


def forget(key: str) -> None:
    """The loop ``key`` retries no more (a holding lost or released): not waited for."""
    with _lock:
        _failing.pop(key, None)


def writable(key: str | None = None) -> None:
    """A loop (``key``, as it gave it to ``retrying``) wrote: if the database had
    taken no writes, and no other loop still meets that, say that it does again."""
    global _since
    with _lock:
        # No key: the caller says writes are accepted, whoever failed before.
        met = key is None or _failing.pop(key, None) is not None
        if _since is None:
            return
        now = time.monotonic()
        for stale in [k for k, at in _failing.items() if now - at > FORGET]:
            del _failing[stale]
        if _failing or (not met and now - _once_at < ONCE_GRACE):
            return
        took, _since = now - _since, None
    log.warning("the database takes writes again, after %.1f s without", took)
