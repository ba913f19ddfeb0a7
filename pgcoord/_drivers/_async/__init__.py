"""A driver session's interface, in two halves: ``_async`` is written by hand, and
``_sync`` is generated from it by tools/generate_sync.py (unasync)."""
