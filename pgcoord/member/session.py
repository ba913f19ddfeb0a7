"""A member's main session as one feature sees it (``MemberSession``), and the
``SessionLost`` it raises when that session is gone."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._drivers.dedicated import HolderConnection

if TYPE_CHECKING:
    from .member import Member

log = logging.getLogger("pgcoord.member")


async def unlock_owned(member: Member, incarnation: int,
                       owned: collections.Counter[tuple[int, bool]]) -> None:
    """Unlock what a feature left held on ``member``'s session (each level taken), while
    that session (``incarnation``) lives: the server let go of the rest with it."""
    from .._core.queries import query

    for (key, shared), count in owned.items():
        fn = "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
        for _ in range(count):
            if member.id != incarnation:
                return
            try:
                await member._call(query("advisory_call").format(fn=fn), key)
            except SessionLost:
                return
            except Exception as exc:
                log.warning("member %r: unlocking %d failed: %r", member.name, key, exc)


class SessionLost(Exception):
    """The member's session is gone (internal: features map it to their own
    errors; it carries no SQLSTATE, so ``_errmap.session_gone`` says yes)."""


class MemberSession(HolderConnection):
    """A member's main session seen as one feature's connection: statements go
    through the member (serialised with everyone else's), ``on_lost`` fires when
    this incarnation of the session ends, and the feature never closes it. Keys
    the feature records in ``owned`` are unlocked when it lets go (``close_now``)."""

    def __init__(self, member: Member, incarnation: int, main: HolderConnection) -> None:
        self._member = member
        self._incarnation = incarnation
        self._main = main
        self.conn = main.conn
        self.backend_pid = main.backend_pid
        self.owned: collections.Counter[tuple[int, bool]] = collections.Counter()
        self._unhooks: list[Callable[[], None]] = []
        self._dropped = False

    def _check(self) -> None:
        if self._dropped or self._member.id != self._incarnation:
            raise SessionLost("this member session has ended")

    async def fetchval(self, sql: str, *args: Any) -> Any:
        self._check()
        return await self._member._call(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> tuple[Any, ...] | None:
        self._check()
        row = await self._member._call(sql, *args, how="row")
        return None if row is None else tuple(row)

    async def execute(self, sql: str) -> None:
        self._check()
        await self._member._call(sql, how="exec")

    def on_lost(self, callback: Callable[[], None]) -> None:
        incarnation = self._incarnation

        def hook(old_id: int) -> None:
            if old_id == incarnation:
                callback()

        self._unhooks.append(self._member.on_session_lost(hook))
        if self._member.id != incarnation:
            callback()

    def announced_pid(self) -> int | None:
        return self._main.announced_pid()

    def unlock_later(self, key: int, count: int = 1) -> None:
        """Unlock ``key`` (``count`` levels) in the background, if this incarnation of
        the session still lives (else it went with the session)."""
        if self._member.id == self._incarnation:
            self._member._spawn(
                unlock_owned(self._member, self._incarnation, collections.Counter({(key, False): count})),
                f"pgcoord-member-release:{self._member.name}")

    def terminate(self) -> None:
        """Let go without waiting: the member's session stays; keys this feature
        owned are unlocked in the background."""
        if self._dropped:
            return
        self._dropped = True
        for unhook in self._unhooks:
            unhook()
        owned, self.owned = self.owned, collections.Counter()
        if owned and self._member.id == self._incarnation:
            self._member._spawn(unlock_owned(self._member, self._incarnation, owned),
                                f"pgcoord-member-release:{self._member.name}")

    def abort(self) -> None:
        """A statement of ours got no answer within its bound. On a shared session
        that usually means it queued behind another feature's statement, not that
        the session is dead: the feature lets go, and the member's own bounded
        heartbeat decides whether the session is still usable."""
        self.terminate()

    async def close_now(self) -> None:
        self.terminate()

    async def give_back(self) -> None:
        self.terminate()
