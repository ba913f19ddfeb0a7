"""One dashboard's state (its reader, sampler, CSRF secret and access), and what a
request says about where and who it is."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from .reader import Reader
from .sample import Sample, read_sample
from .sampler import Sampler
from .security import Access, Csrf, check_access


class Dashboard:
    """The state one app holds: its reader, its sampler, its CSRF secret, its access."""

    def __init__(self, source: Any, access: Access | None, basic: tuple[str, str] | None) -> None:
        self.reader = Reader(source)
        self.source = source
        self.access = check_access(access)
        self.basic = basic
        self.csrf = Csrf()
        self._with_terms: bool | None = None
        self.sampler = Sampler(self._read)

    async def _read(self) -> Sample:
        sample, self._with_terms = await read_sample(self.reader, with_terms=self._with_terms)
        return sample

    async def aclose(self) -> None:
        await self.sampler.stop()
        await self.reader.aclose()


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
