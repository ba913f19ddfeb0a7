"""Sync twins of pgcoord's classes, for code without an event loop (Django, Celery,
Flask, scripts): ``pgcoord.sync.Member``, ``LockHolder``, ``Lease``, ``Elector``,
``Scheduler``.

They are not a second implementation: each twin drives the async class on one event
loop that pgcoord runs on a thread of its own (the *portal*), so the guarantees and
the code are the same. User code — a ``with`` block, a ``lead``, a job — runs on the
caller's threads, and since a thread cannot be cancelled it is *told* when it must
stop (``held.lost``, ``term.lost``, ``sched.slot_lost(slot)``) and is waited for before
the lock, lease or claim is given up. ``pgcoord.exclusive()`` and ``check_fence`` take
sync connections directly, on the caller's own connection and transaction.
"""

from ._bridge import Held, Term
from ._twins import Elector, Lease, LockHolder, Member, Scheduler

__all__ = ["Elector", "Held", "Lease", "LockHolder", "Member", "Scheduler", "Term"]
