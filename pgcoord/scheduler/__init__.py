"""``Scheduler``: run-once cron across replicas, on ``pgcoord.job_slots``.

The package's modules, one concept each:

- ``loop``: the ``Scheduler`` itself (registration, the schedules API, the loop).
- ``cron``: slot arithmetic, with no I/O.
- ``runner``: running one claimed slot.
- ``finisher``: recording the ends of runs, many per statement.
- ``alerts``: schedules that keep failing.
"""

from .._drivers.capacity import pool_capacity
from .loop import Scheduler
from .runner import Slot

__all__ = ["Scheduler", "Slot", "pool_capacity"]
