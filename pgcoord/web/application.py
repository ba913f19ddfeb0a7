"""The dashboard as an ASGI app: routes, errors, the live stream, the actions."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .._core.errmap import sqlstate
from .._core.queries import query
from ..leases.statements import validate_name
from ..scheduler.schedules import infos
from . import model
from .reader import Reader
from .sample import Sample, read_sample
from .sampler import Sampler
from .security import (
    ACTIONS,
    CSRF_COOKIE,
    CSRF_FIELD,
    Access,
    Csrf,
    allowed_actions,
    basic_auth_from_env,
    check_access,
    check_basic,
)
from .views import render, static_file

log = logging.getLogger("pgcoord.web")

#: The pages, in the order of the navigation bar: (path, title).
PAGES = (("/", "Overview"), ("/elections", "Elections"), ("/members", "Members"),
         ("/locks", "Locks"), ("/schedules", "Schedules"))
FRAGMENT_HEADER = "x-pgcoord-fragment"
#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE = 15.0
#: Bytes an action's form may take.
FORM_MAX = 16384
INSUFFICIENT_PRIVILEGE = "42501"


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


# -- requests -------------------------------------------------------------------------------

def _dash(request: Request) -> Dashboard:
    dash: Dashboard = request.app.state.pgcoord_dashboard
    return dash


def _base(request: Request) -> str:
    return str(request.scope.get("root_path", "")).rstrip("/")


def who(request: Request) -> str:
    """Who asked: the basic-auth user, else the client's address."""
    user = request.scope.get("pgcoord.user")
    if user:
        return str(user)
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown client"


def _page_number(request: Request) -> int:
    raw = request.query_params.get("page", "1")
    if not raw.isdigit() or not raw.isascii() or int(raw) < 1:
        raise HTTPException(400, f"page must be a whole number from 1 up, not {raw!r}")
    return int(raw)


def _check_name(name: str, what: str) -> str:
    if not name:
        raise HTTPException(400, f"a {what} name is needed")
    if "\x00" in name:
        raise HTTPException(400, f"a {what} name cannot contain a NUL character")
    return name


async def _html(request: Request, template: str, sample: Sample, data: dict[str, Any],
                **extra: Any) -> Response:
    dash = _dash(request)
    allowed = await allowed_actions(dash.access, request)
    nonce = request.cookies.get(CSRF_COOKIE) or dash.csrf.new_nonce()
    fragment = request.headers.get(FRAGMENT_HEADER) == "1"
    body = render(
        template, layout="fragment.html" if fragment else "base.html", base=_base(request),
        path=request.url.path[len(_base(request)):] or "/", pages=PAGES, sample=sample, data=data,
        allowed=allowed, csrf=dash.csrf.token(nonce), csrf_field=CSRF_FIELD, who=who(request),
        next_url=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
        **extra,
    )
    response = HTMLResponse(body, headers={"X-Pgcoord-Version": sample.version,
                                           "Cache-Control": "no-store"})
    if request.cookies.get(CSRF_COOKIE) != nonce:
        response.set_cookie(CSRF_COOKIE, nonce, path=(_base(request) or "") + "/", httponly=True,
                            samesite="strict")
    return response


def _json(sample: Sample, data: dict[str, Any]) -> Response:
    status = 200 if sample.error is None else 503
    return JSONResponse({**data, "health": model.health(sample)} if "health" not in data else data,
                        status_code=status, headers={"Cache-Control": "no-store"})


def _page(template: str, build: Callable[[Sample, Request], dict[str, Any]]
          ) -> tuple[Callable[[Request], Awaitable[Response]], Callable[[Request], Awaitable[Response]]]:
    async def html(request: Request) -> Response:
        sample = await _dash(request).sampler.current()
        return await _html(request, template, sample, build(sample, request))

    async def api(request: Request) -> Response:
        sample = await _dash(request).sampler.current()
        return _json(sample, build(sample, request))

    return html, api


overview, overview_api = _page("overview.html", lambda s, r: model.overview(s))
elections, elections_api = _page("elections.html", lambda s, r: model.elections(s))
members, members_api = _page("members.html", lambda s, r: model.members(s))
locks, locks_api = _page("locks.html", lambda s, r: model.locks(s))


async def _schedules_data(request: Request) -> tuple[Sample, dict[str, Any]]:
    dash = _dash(request)
    page = _page_number(request)
    sample = await dash.sampler.current()
    try:
        names = model.schedule_names(sample, page)
    except model.PageOutOfRange as exc:
        raise HTTPException(404, str(exc)) from None
    row = await dash.reader.row(query("web_schedule_rows"), (names,)) if names else None
    now, rows = (row[0], row[1]) if row else (sample.now, "[]")
    return sample, model.schedules(sample, page, now, rows)


async def schedules(request: Request) -> Response:
    sample, data = await _schedules_data(request)
    return await _html(request, "schedules.html", sample, data)


async def schedules_api(request: Request) -> Response:
    sample, data = await _schedules_data(request)
    return _json(sample, data)


async def _schedule_data(request: Request) -> tuple[Sample, dict[str, Any]]:
    dash = _dash(request)
    name = _check_name(request.path_params["name"], "schedule")
    page = _page_number(request)
    sample = await dash.sampler.current()
    row = await dash.reader.row(query("schedule_list"), (name,))
    assert row is not None
    found = [model.schedule_json(i) for i in infos(row[0], row[1])]
    slots = json.loads(await dash.reader.value(query("web_slots"), (name, model.SLOTS_PER_PAGE, 0)
                                               if page == 1 else (name, 0, 0)))
    total = slots["total"]
    if not found and total == 0:
        raise HTTPException(404, f"no schedule named {name!r}, and no slots recorded under it")
    try:
        skip = model.check_page(page, total, model.SLOTS_PER_PAGE)
    except model.PageOutOfRange as exc:
        raise HTTPException(404, str(exc)) from None
    if page != 1:
        slots = json.loads(await dash.reader.value(query("web_slots"),
                                                   (name, model.SLOTS_PER_PAGE, skip)))
    info = found[0] if found else None
    if info is not None:
        info["failing"] = bool(info["error"]) or model.failing(info)
    return sample, {"name": name, "schedule": info, "slots": slots["slots"], "total": total,
                    "page": page, "pages": model.pages(total, model.SLOTS_PER_PAGE)}


async def schedule(request: Request) -> Response:
    if not request.path_params["name"]:
        return RedirectResponse(_base(request) + "/schedules", 303)
    sample, data = await _schedule_data(request)
    return await _html(request, "schedule.html", sample, data)


async def schedule_api(request: Request) -> Response:
    sample, data = await _schedule_data(request)
    return _json(sample, data)


# -- live -----------------------------------------------------------------------------------

class EventStream:
    """``/events``: server-sent events carrying the sample's version, sent again
    whenever it changes, and a comment every KEEPALIVE seconds otherwise.

    A bare ASGI endpoint rather than a streaming response, so that a page that goes
    away (its ``http.disconnect``) ends the stream at once, and with it the page's
    share of the sampler, whichever version of ASGI the server speaks."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sampler = _dash(Request(scope, receive)).sampler
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        async with sampler.listening() as next_change:
            watcher = asyncio.get_running_loop().create_task(watch(), name="pgcoord.web page gone?")
            try:
                sample = await sampler.current()
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]})
                await self._send(send, f"retry: 1000\nevent: version\ndata: {sample.version}\n\n")
                while True:
                    new = await _until_gone(next_change(sample.version, KEEPALIVE), gone)
                    if new is None:
                        return
                    if new.version == sample.version:
                        await self._send(send, ": still here\n\n")
                    else:
                        await self._send(send, f"event: version\ndata: {new.version}\n\n")
                    sample = new
            except OSError:  # the page went away mid-send (ASGI 2.4 servers tell it so)
                return
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

    @staticmethod
    async def _send(send: Send, text: str) -> None:
        await send({"type": "http.response.body", "body": text.encode(), "more_body": True})


async def _until_gone(waiting: Awaitable[Sample], gone: asyncio.Event) -> Sample | None:
    """``waiting``'s sample, or None once the page is gone (``waiting`` is cancelled)."""
    task = asyncio.ensure_future(waiting)
    stop = asyncio.get_running_loop().create_task(gone.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    return None if gone.is_set() or task.cancelled() else task.result()


async def static(request: Request) -> Response:
    name = request.path_params["file"]
    types = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
    if name not in types:
        raise HTTPException(404, f"no static file {name!r}")
    return Response(static_file(name), media_type=types[name],
                    headers={"Cache-Control": "public, max-age=300"})


# -- actions --------------------------------------------------------------------------------

async def action(request: Request) -> Response:
    dash = _dash(request)
    verb = request.path_params["action"]
    if verb not in ACTIONS:
        raise HTTPException(404, f"no action {verb!r}: the actions are {', '.join(ACTIONS)}")
    form = await _form(request)
    name = _check_name(str(form.get("name") or ""), "lease" if verb == "resign" else "schedule")
    by = who(request)
    if not dash.csrf.valid(request.cookies.get(CSRF_COOKIE), str(form.get(CSRF_FIELD) or "")):
        _audit(verb, name, by, "refused: bad CSRF token")
        raise HTTPException(403, "CSRF check failed: the form's token does not match this browser's "
                                 "cookie (reload the page and try again)")
    if verb not in await allowed_actions(dash.access, request):
        _audit(verb, name, by, "refused: not allowed")
        raise HTTPException(403, f"{verb} is not allowed here: this dashboard is read-only for you")
    try:
        done = await _perform(dash, verb, name)
    except ValueError as exc:  # a name pgcoord refuses
        raise HTTPException(400, str(exc)) from None
    except Exception as exc:
        if sqlstate(exc) != INSUFFICIENT_PRIVILEGE:
            raise
        _audit(verb, name, by, "refused by the database: " + str(exc).splitlines()[0])
        raise HTTPException(403, f"the database refused to {verb} {name!r}: {str(exc).splitlines()[0]} "
                                 "(the dashboard's role lacks a grant: see docs/web.md, Roles)") from None
    if not done:
        _audit(verb, name, by, "not found")
        what = "lease with a live holder" if verb == "resign" else "schedule"
        raise HTTPException(404, f"no {what} named {name!r}")
    _audit(verb, name, by, "done")
    if "application/json" in request.headers.get("accept", ""):
        return JSONResponse({"action": verb, "name": name, "by": by, "done": True})
    return RedirectResponse(_safe_next(request, str(form.get("next") or "")), 303)


async def _form(request: Request) -> dict[str, str]:
    """The action's urlencoded form (no multipart library needed for four fields)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise HTTPException(415, "an action is a form post (application/x-www-form-urlencoded)")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > FORM_MAX:
            raise HTTPException(413, f"an action's form is at most {FORM_MAX} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=10)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HTTPException(400, f"the form cannot be read: {exc}") from None
    return {k: v[-1] for k, v in fields.items()}


async def _perform(dash: Dashboard, verb: str, name: str) -> bool:
    if verb == "resign":
        # What request_resign() runs (elector/resign.py), on the dashboard's own reader,
        # which may be a sync pool too; the poke is a courtesy: without the right to
        # signal the services' sessions the leader steps down at its next renewal.
        asked = bool(await dash.reader.value(query("lease_request_resign"), (validate_name(name),)))
        if asked:
            try:
                await dash.reader.value(query("lease_poke"), (name,))
            except Exception as exc:
                log.warning("pgcoord.web: resign %r asked; its candidates were not woken (%s): "
                            "the leader steps down at its next renewal", name, exc)
        return asked
    if verb == "trigger":
        return await dash.reader.value(query("schedule_trigger"), (name,)) is not None
    if verb == "pause":
        return bool(await dash.reader.value(query("schedule_pause"), (name,)))
    return bool(await dash.reader.value(query("schedule_resume"), (name, "none")))


def _audit(verb: str, name: str, by: str, outcome: str) -> None:
    log.info("pgcoord.web: %s %r by %s: %s", verb, name, by, outcome,
             extra={"pgcoord": {"event": "web_action", "action": verb, "name": name, "by": by,
                                "outcome": outcome}})


def _safe_next(request: Request, target: str) -> str:
    """Back to the page the form was on, never to another site."""
    base = _base(request)
    if target.startswith((base + "/") if base else "/") and not target.startswith("//") \
            and "\\" not in target and "\r" not in target and "\n" not in target:
        return target
    return base + "/"


# -- errors ---------------------------------------------------------------------------------

async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(request, exc.status_code, exc.detail, exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("pgcoord.web: %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(request, 500, f"the dashboard failed: {type(exc).__name__} (details in the server's log)")


def _error(request: Request, status: int, detail: str, headers: Any = None) -> Response:
    path = request.url.path[len(_base(request)):]
    if path.startswith("/api") or "application/json" in request.headers.get("accept", ""):
        return JSONResponse({"error": detail, "status": status}, status_code=status, headers=headers)
    body = render("error.html", layout="base.html", base=_base(request), path=path, pages=PAGES,
                  status=status, detail=detail, sample=None)
    return HTMLResponse(body, status_code=status, headers=headers)


# -- basic auth -----------------------------------------------------------------------------

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


# -- the app --------------------------------------------------------------------------------

def app(source: Any, access: Access | None = None) -> Starlette:
    """The operators' dashboard as an ASGI app (docs/web.md).

    ``source``: a DSN (the dashboard opens a small pool of its own on first use) or
    the application's pool or engine (asyncpg, psycopg, SQLAlchemy; async or sync).
    ``access(request)`` returns ``"all"``, ``"read_only"`` or a set of action names
    (``pause``, ``resume``, ``trigger``, ``resign``); without it the dashboard is
    read-only. ``PGCOORD_WEB_USER`` and ``PGCOORD_WEB_PASSWORD`` turn on basic auth.
    """
    dash = Dashboard(source, access, basic_auth_from_env())

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await dash.aclose()

    routes = [
        Route("/", overview), Route("/api", overview_api), Route("/api/", overview_api),
        Route("/elections", elections), Route("/api/elections", elections_api),
        Route("/members", members), Route("/api/members", members_api),
        Route("/locks", locks), Route("/api/locks", locks_api),
        Route("/schedules", schedules), Route("/api/schedules", schedules_api),
        Route("/schedules/{name:path}", schedule), Route("/api/schedules/{name:path}", schedule_api),
        Route("/events", EventStream()), Route("/static/{file}", static),
        Route("/actions/{action}", action, methods=["POST"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        HTTPException: http_error, Exception: server_error,
    }
    starlette = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    starlette.state.pgcoord_dashboard = dash
    if dash.basic is not None:
        starlette.add_middleware(BasicAuth, credentials=dash.basic)
    return starlette


async def aclose(asgi_app: Starlette) -> None:
    """Stop the sampler and close the dashboard's own pool: for an app mounted in
    another (whose lifespan does not run the dashboard's), from that app's shutdown."""
    await asgi_app.state.pgcoord_dashboard.aclose()
