"""``LockHolder``: session locks (and semaphores) on a dedicated connection."""

from .holder import HeldLock, LockHolder

__all__ = ["HeldLock", "LockHolder"]
