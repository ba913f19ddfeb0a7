"""One dashboard's state (its reader, sampler, CSRF secret and access), and what a
request says about where and who it is."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from . import shared
from .reader import Reader
from .sampler import Sampler
from .security import Access, Csrf, check_access


class Dashboard:
    """The state one app holds: its CSRF secret, its access, and its share of the
    process's reader and sampler for its source (shared.py)."""

    def __init__(self, source: Any, access: Access | None, basic: tuple[str, str] | None) -> None:
        Reader(source)  # refuses what cannot be read from, at app()
        self.source = source
        self.access = check_access(access)
        self.basic = basic
        self.csrf = Csrf()
        #: The share taken last (tests and the benchmark look at its sampler).
        self.latest: shared.Shared | None = None
        self._closing: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}

    def closing(self) -> asyncio.Event:
        """Set when the server goes down: open event streams end (end_streams)."""
        return self._closing.setdefault(asyncio.get_running_loop(), asyncio.Event())

    def end_streams(self) -> None:
        """End every open event stream, on the serving loop (from its thread). A
        server waits for open responses before it stops, and a page never ends its
        stream; pgcoord web calls this when told to stop."""
        for event in self._closing.values():
            event.set()

    def _share(self) -> shared.Shared:
        entry = self.latest
        loop = asyncio.get_running_loop()
        if entry is None or entry.key[1] is not loop or not shared.live(entry):
            if entry is not None:  # served again, on another loop: the old share is done
                shared.forget(entry, self)
            entry = self.latest = shared.acquire(self.source, self)
        return entry

    @property
    def reader(self) -> Reader:
        return self._share().reader

    @property
    def sampler(self) -> Sampler:
        return self._share().sampler

    async def aclose(self) -> None:
        self._closing.clear()
        entry, self.latest = self.latest, None
        if entry is not None:
            await shared.release(entry, self)


def dashboard_of(request: Request) -> Dashboard:
    dash: Dashboard = request.app.state.pgcoord_dashboard
    return dash


def base_of(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def who(request: Request) -> str:
    """Who asked: the basic-auth user, else the client's address."""
    user = request.scope.get("pgcoord.user")
    if user:
        return str(user)
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown client"


def check_name(name: str, what: str) -> str:
    if not name:
        raise HTTPException(400, f"a {what} name is needed")
    if "\x00" in name:
        raise HTTPException(400, f"a {what} name cannot contain a NUL character")
    return name
