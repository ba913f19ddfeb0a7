"""A database that takes no writes, as an ordinary state: said once, not once a retry.

A primary that its HA manager demoted (Patroni without its DCS restarts it as a
standby until it is promoted again), a standby, or ``default_transaction_read_only``:
every background loop of pgcoord (elector campaigns, lease renewals, scheduler
ticks, a member joining again) fails and backs off, each retry for as long as the
state lasts. That is expected and needs one line in the logs, not one per retry per
loop: the first loop to meet it logs a warning, the others log their retries at DEBUG,
and the first success after it logs that writes are accepted again, with how long
the state lasted. The notice is per process: an operator reads one process's log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import errmap

log = logging.getLogger("pgcoord")

_since: float | None = None  # monotonic time the state was first met, while it lasts


def retrying(logger: logging.Logger, exc: BaseException, message: str, *args: Any) -> None:
    """Log a background failure after ``exc`` (a loop's retry, a release given up
    to expiry): as before (a warning) unless the database takes no writes; then the
    notice, once per process until it does again, and this at DEBUG."""
    global _since
    if not errmap.read_only(exc):
        logger.warning(message, *args)
        return
    if _since is None:
        _since = time.monotonic()
        log.warning("the database takes no writes now (%r): a primary demoted to read-only (an HA "
                    "manager such as Patroni, which demotes the primary when it loses its DCS), a "
                    "standby, or default_transaction_read_only. pgcoord backs off and tries again "
                    "until a primary takes writes; this is said once, not once per retry", exc)
    logger.debug(message, *args)


def writable() -> None:
    """A loop wrote: if the database had taken no writes, say that it does again."""
    global _since
    if _since is not None:
        took, _since = time.monotonic() - _since, None
        log.warning("the database takes writes again, after %.1f s without", took)
