"""Transaction scope: ``exclusive()``, ``semaphore()`` and ``check_fence``.

Each is one object for ``async with`` and ``with`` (``pgcoord.locks.advisory``,
``pgcoord.locks.semaphores``, ``pgcoord.leases.fence``), made of two halves:

- ``_async/``, the one hand-written implementation, on ``AsyncTxSession``;
- ``_sync/``, generated from it by tools/generate_sync.py (unasync), on
  ``SyncTxSession``; a test fails when it is not current.

What both halves share (state, validation, messages) is in the modules here, and
what must differ between them (how a cleanup is bounded, how a wait sleeps) comes
from helpers that exist in an ``_async`` and a ``_sync`` form.
"""

# A pooled connection that the server ended while it sat idle in its pool
# (pg_terminate_backend, a restart, idle_session_timeout) is found out only at its
# first statement. Nothing is locked and no user code has run then, so the lock is
# asked for again on another connection, this many more times at most.
DEAD_POOLED_RETRIES = 2
