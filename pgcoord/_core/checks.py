"""Checks of the values a caller hands pgcoord, shared by every public constructor
and call: a value the database cannot store, or a background loop cannot use, is
refused where it is given (``ValueError``; ``TypeError`` for a wrong type), never
met later as a driver error or a loop that fails at every pass.
"""

from __future__ import annotations

import math
from typing import Any

#: The longest duration pgcoord takes, in seconds (about 100 years). Durations are
#: added to and subtracted from the database clock, and sent as milliseconds in a
#: bigint: far beyond this, ``timestamp out of range``.
SECONDS_MAX = 100 * 365.25 * 86400.0
#: The longest name (UTF-8 bytes) pgcoord stores: a name is a primary key, and a
#: btree entry holds at most about 2,700 bytes.
NAME_MAX_BYTES = 1000
INT4_MAX = 2**31 - 1
#: The longest lock wait pgcoord sets (``lock_timeout`` is an int of milliseconds).
LOCK_TIMEOUT_MAX = INT4_MAX / 1000
#: The longest keepalive of a session: ``tcp_user_timeout`` (milliseconds, an int)
#: comes from it, and a liveness bound of more than a day is none.
KEEPALIVE_MAX = 86400.0


def seconds(value: Any, what: str, *, allow_none: bool = False, minimum: float = 0.0,
            maximum: float = SECONDS_MAX) -> float | None:
    """``value`` as a float of seconds in [minimum, maximum]; None if allowed.
    NaN and infinity are refused: no duration of pgcoord's means "for ever" as a
    number (None says "no bound" where there is one)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number of seconds >= {minimum}, got {value!r}")
    if not math.isfinite(value) or value < minimum or value > maximum:
        bound = f"from {minimum} to {maximum:.0f}"
        hint = " (None for no bound)" if allow_none else ""
        raise ValueError(f"{what} must be a finite number of seconds {bound}{hint}, got {value!r}")
    return float(value)


def duration(value: Any, what: str, *, minimum: float, maximum: float, why: str = "") -> float:
    """``value`` as a float of seconds in [minimum, maximum]: ``TypeError`` if it is
    not a number, ``ValueError`` if NaN, infinite or out of range (``why`` says where
    the maximum comes from)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{what} must be at least {minimum:g} s, got {value}")
    if value > maximum:
        raise ValueError(f"{what} must be at most {maximum:.0f} s{why}, got {value}")
    return float(value)


def text(value: Any, what: str, *, max_bytes: int | None = NAME_MAX_BYTES,
         empty: bool = False) -> str:
    """``value`` if it is a str PostgreSQL can store: no NUL character (text refuses
    it), at most ``max_bytes`` of UTF-8 (None: no bound), non-empty unless ``empty``."""
    if not isinstance(value, str) or (not value and not empty):
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain a NUL character (PostgreSQL text cannot hold one), "
                         f"got {value!r}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate
        raise ValueError(f"{what} is not valid Unicode text: {exc}") from None
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{what} is {size} bytes of UTF-8; at most {max_bytes} are allowed")
    return value


def count(value: Any, what: str, *, minimum: int = 1, maximum: int = INT4_MAX) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{what} must be an int from {minimum} to {maximum}, got {value!r}")
    return value


#: How deep a JSON value pgcoord stores may nest (PostgreSQL's jsonb parser runs out
#: of stack far deeper, at a depth that depends on max_stack_depth).
JSON_DEPTH_MAX = 1000


def no_nul(value: Any, what: str) -> None:
    """ValueError if jsonb cannot store a JSON value: a NUL character or a lone
    surrogate in a string or key (jsonb, like text, cannot hold either), or nesting
    deeper than JSON_DEPTH_MAX."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > JSON_DEPTH_MAX:
            raise ValueError(f"{what} nests deeper than {JSON_DEPTH_MAX} levels")
        if isinstance(item, str):
            if "\x00" in item:
                raise ValueError(f"{what} must not contain a NUL character (jsonb cannot hold one)")
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"{what} holds text that is not valid Unicode: {exc.reason}") from None
        elif isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
