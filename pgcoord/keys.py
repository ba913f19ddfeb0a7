"""Lock keys: the one mapping from user keys to PostgreSQL's bigint advisory keys.

The string scheme is part of the public contract and is stable forever: the first
8 bytes of SHA-256 of the UTF-8 name, read big-endian as a signed 64-bit integer.
The SQL function ``pgcoord.lock_key(text)`` computes the same number.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

LockKeyLike = int | str


def lock_key(key: LockKeyLike) -> int:
    """Return the bigint advisory-lock key for ``key``.

    An ``int`` is range-checked and returned unchanged; a ``str`` is hashed.
    ``bool`` is refused even though it is an ``int``: ``True`` as a lock key is
    almost always a bug.
    """
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(
            f"lock key must be an int or a str, not {type(key).__name__}"
        )
    if isinstance(key, int):
        if not INT64_MIN <= key <= INT64_MAX:
            raise ValueError(f"lock key {key} is outside the signed 64-bit range")
        return key
    return _hash_name(key)


@lru_cache(maxsize=4096)
def _hash_name(name: str) -> int:
    if "\x00" in name:
        # PostgreSQL text cannot hold one: pgcoord.lock_key() in SQL, the lock's
        # recorded name and pgcoord.holders could never name this lock.
        raise ValueError(f"lock name {name!r} contains a NUL character, which PostgreSQL text "
                         "cannot hold")
    try:
        data = name.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"lock name {name!r} is not valid Unicode text: {exc.reason}") from None
    digest = hashlib.sha256(data).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def key_and_name(key: LockKeyLike) -> tuple[int, str | None]:
    """Normalise ``key`` and keep its name when it has one."""
    return lock_key(key), key if isinstance(key, str) else None


# The classid of Member's alive locks (sql/0004_members.up.sql, member_alive_ns()).
MEMBER_ALIVE_NS = 1885823853


@lru_cache(maxsize=4096)
def semaphore_key(name: str) -> int:
    """The lane namespace of semaphore ``name``: the high 32 bits of
    ``lock_key(name)``, signed, as the SQL function ``pgcoord.semaphore_key(text)``.

    Its lanes are the two-int advisory locks ``(k, 0) .. (k, limit - 1)``. The one
    value that is Member's alive-lock namespace moves next to it. Stable forever.
    """
    if not isinstance(name, str):
        raise TypeError(f"semaphore name must be a str, not {type(name).__name__}")
    k = _hash_name(name) >> 32
    return k - 1 if k == MEMBER_ALIVE_NS else k
