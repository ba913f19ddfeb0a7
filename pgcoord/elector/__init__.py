"""``Elector``: leader election over a lease with a doorbell."""

from .elector import Elector, LeaderChanged, request_resign

__all__ = ["Elector", "LeaderChanged", "request_resign"]
