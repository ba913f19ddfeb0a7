"""``Partitions``: parts spread over live members, each owned under a fence."""

from .partitions import Partition, Partitions

__all__ = ["Partition", "Partitions"]
