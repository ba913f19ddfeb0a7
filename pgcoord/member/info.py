"""What a member is to others: ``MemberInfo``, the changes ``watch()`` yields, and the
checks on what a member is given."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .._core.checks import KEEPALIVE_MAX, duration, no_nul, text
from ..errors import PgcoordError


@dataclass(frozen=True)
class MemberInfo:
    """One live member as the database records it."""

    id: int
    name: str
    group: str
    meta: dict[str, Any] = field(compare=False)
    joined_at: dt.datetime = field(compare=False)


@dataclass(frozen=True)
class MemberJoined:
    member: MemberInfo


@dataclass(frozen=True)
class MemberLeft:
    member: MemberInfo
    #: ``left`` (it said goodbye), ``crashed`` (its session ended while it was
    #: heartbeating), ``silent`` (it had stopped heartbeating first: paused, cut off).
    reason: Literal["left", "crashed", "silent"]


MemberChange = MemberJoined | MemberLeft


class NameTaken(PgcoordError):
    """A live member of this group already has this name."""


def _default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def _validate(group: Any, name: Any, meta: Any, ttl: Any) -> tuple[str, str, str, float]:
    text(group, "group")
    if name is None:
        name = _default_name()
    text(name, "name")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict, not {type(meta).__name__}")
    try:
        meta_json = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable: {exc}") from None
    no_nul(meta, "meta")
    # The session's TCP keepalive and tcp_user_timeout come from the ttl.
    ttl = duration(ttl, "ttl", minimum=1.0, maximum=KEEPALIVE_MAX, why=" (its tcp_user_timeout)")
    return group, name, meta_json, ttl


def _info(row: dict[str, Any]) -> MemberInfo:
    return MemberInfo(
        id=int(row["id"]), name=str(row["name"]), group=str(row["group"]),
        meta=dict(row["meta"] or {}), joined_at=dt.datetime.fromisoformat(row["joined_at"]),
    )


def _add_hook(hooks: list[Callable[[int], None]], hook: Callable[[int], None]) -> Callable[[], None]:
    hooks.append(hook)

    def remove() -> None:
        if hook in hooks:
            hooks.remove(hook)

    return remove


def _as_reason(reason: str) -> Literal["left", "crashed", "silent"]:
    return "left" if reason == "left" else "silent" if reason == "silent" else "crashed"
