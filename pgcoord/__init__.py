"""pgcoord: coordination for services using only the PostgreSQL they already write to.

Importing pgcoord imports no database driver; each feature loads the driver of
the object it is given.
"""

from ._core.version import __version__
from .elector import Elector, LeaderChanged, request_resign
from .errors import (
    Deadlock,
    LeaseLost,
    LockBusy,
    LockLost,
    LockTableFull,
    LockTimeout,
    PgcoordError,
    PoolExhausted,
    SchemaMissing,
    StaleFence,
    UnsupportedConnection,
)
from .holder import HeldLock, LockHolder
from .keys import lock_key
from .leases import Lease, check_fence
from .locks import ExclusiveLock, Semaphore, exclusive, semaphore
from .member import Member, MemberInfo, MemberJoined, MemberLeft
from .partitions import Partition, Partitions
from .scheduler import Scheduler, Slot
from .scheduler.schedules import ScheduleInfo

__all__ = [
    "Deadlock",
    "Elector",
    "ExclusiveLock",
    "HeldLock",
    "LeaderChanged",
    "Lease",
    "LeaseLost",
    "LockBusy",
    "LockHolder",
    "LockLost",
    "LockTableFull",
    "LockTimeout",
    "Member",
    "MemberInfo",
    "MemberJoined",
    "MemberLeft",
    "Partition",
    "Partitions",
    "PgcoordError",
    "PoolExhausted",
    "ScheduleInfo",
    "Scheduler",
    "SchemaMissing",
    "Semaphore",
    "Slot",
    "StaleFence",
    "UnsupportedConnection",
    "__version__",
    "check_fence",
    "exclusive",
    "lock_key",
    "request_resign",
    "semaphore",
]
