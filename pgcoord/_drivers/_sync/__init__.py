# Generated from pgcoord/_drivers/_async/__init__.py by tools/generate_sync.py: do not edit.
"""A driver session's interface, in two halves: ``_async`` is written by hand, and
``_sync`` is generated from it by tools/generate_sync.py (unasync)."""
