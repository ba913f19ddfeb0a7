"""HTTP basic auth in front of every path of the dashboard."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from .security import check_basic


class BasicAuth:
    """401 for any request without the configured credentials (static files too)."""

    def __init__(self, app: ASGIApp, credentials: tuple[str, str]) -> None:
        self.app, self.credentials = app, credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization")
        user = check_basic(header.decode("latin-1") if header else None, self.credentials)
        if user is None:
            response = Response("pgcoord: this dashboard needs a user name and password\n",
                                status_code=401, media_type="text/plain",
                                headers={"WWW-Authenticate": 'Basic realm="pgcoord", charset="UTF-8"'})
            await response(scope, receive, send)
            return
        scope["pgcoord.user"] = user
        await self.app(scope, receive, send)
