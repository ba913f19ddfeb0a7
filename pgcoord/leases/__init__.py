"""Leases with fencing tokens: ``Lease``, ``check_fence``, and the tenure engine that
every holding of a lease runs on (``tenure``: Lease, Elector terms, partitions, job
claims)."""

from .fence import SQLSTATE_STALE_FENCE, check_fence
from .lease import Lease
from .statements import default_holder, validate_holder
from .tenure import trust_margin

__all__ = ["SQLSTATE_STALE_FENCE", "Lease", "check_fence", "default_holder", "trust_margin",
           "validate_holder"]
