"""Transaction-scoped locks: ``exclusive()`` and ``semaphore()``, async and sync
(the sync halves are generated, see ``txscope``)."""

from .advisory import ExclusiveLock, exclusive
from .semaphores import Semaphore, semaphore

__all__ = ["ExclusiveLock", "Semaphore", "exclusive", "semaphore"]
