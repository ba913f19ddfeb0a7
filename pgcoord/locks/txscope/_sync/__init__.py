# Generated from pgcoord/locks/txscope/_async/__init__.py by tools/generate_sync.py: do not edit.
"""The halves of ``exclusive()``, ``semaphore()`` and ``check_fence``: ``_async`` is
written by hand, ``_sync`` is generated from it by tools/generate_sync.py."""
