"""The dashboard as an ASGI app: its pages and their JSON twins, errors, and ``app()``
which puts them together with the live stream (events.py), the actions (actions.py)
and basic auth (auth.py)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from .._core.queries import query
from ..scheduler.schedules import infos
from . import model
from .actions import action
from .auth import BasicAuth
from .dashboard import Dashboard, base_of, check_name, dashboard_of, who
from .events import EventStream
from .reader import DatabaseError
from .sample import Sample
from .security import CSRF_COOKIE, CSRF_FIELD, Access, allowed_actions, basic_auth_from_env
from .views import render, static_file

log = logging.getLogger("pgcoord.web")

#: The pages, in the order of the navigation bar: (path, title).
PAGES = (("/", "Overview"), ("/elections", "Elections"), ("/members", "Members"),
         ("/locks", "Locks"), ("/schedules", "Schedules"))
FRAGMENT_HEADER = "x-pgcoord-fragment"


def _page_number(request: Request) -> int:
    raw = request.query_params.get("page", "1")
    if not raw.isdigit() or not raw.isascii() or int(raw) < 1:
        raise HTTPException(400, f"page must be a whole number from 1 up, not {raw!r}")
    return int(raw)


async def _html(request: Request, template: str, sample: Sample, data: dict[str, Any],
                **extra: Any) -> Response:
    dash = dashboard_of(request)
    allowed = await allowed_actions(dash.access, request)
    nonce = request.cookies.get(CSRF_COOKIE) or dash.csrf.new_nonce()
    fragment = request.headers.get(FRAGMENT_HEADER) == "1"
    body = render(
        template, layout="fragment.html" if fragment else "base.html", base=base_of(request),
        path=request.url.path[len(base_of(request)):] or "/", pages=PAGES, sample=sample, data=data,
        allowed=allowed, csrf=dash.csrf.token(nonce), csrf_field=CSRF_FIELD, who=who(request),
        next_url=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
        **extra,
    )
    response = HTMLResponse(body, headers={"X-Pgcoord-Version": sample.version,
                                           "Cache-Control": "no-store"})
    if request.cookies.get(CSRF_COOKIE) != nonce:
        response.set_cookie(CSRF_COOKIE, nonce, path=(base_of(request) or "") + "/", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
    return response


def _json(sample: Sample, data: dict[str, Any]) -> Response:
    status = 200 if sample.error is None else 503
    return JSONResponse({**data, "health": model.health(sample)} if "health" not in data else data,
                        status_code=status, headers={"Cache-Control": "no-store"})


def _page(template: str, build: Callable[[Sample, Request], dict[str, Any]]
          ) -> tuple[Callable[[Request], Awaitable[Response]], Callable[[Request], Awaitable[Response]]]:
    async def html(request: Request) -> Response:
        sample = await dashboard_of(request).sampler.current()
        return await _html(request, template, sample, build(sample, request))

    async def api(request: Request) -> Response:
        sample = await dashboard_of(request).sampler.current()
        return _json(sample, build(sample, request))

    return html, api


overview, overview_api = _page("overview.html", lambda s, r: model.overview(s))
elections, elections_api = _page("elections.html", lambda s, r: model.elections(s))
members, members_api = _page("members.html", lambda s, r: model.members(s))
def _locks(sample: Sample, request: Request) -> dict[str, Any]:
    try:
        return model.locks(sample, _page_number(request))
    except model.PageOutOfRange as exc:
        raise HTTPException(404, str(exc)) from None


locks, locks_api = _page("locks.html", _locks)


async def _schedules_data(request: Request) -> tuple[Sample, dict[str, Any]]:
    dash = dashboard_of(request)
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
    dash = dashboard_of(request)
    name = check_name(request.path_params["name"], "schedule")
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
        return RedirectResponse(base_of(request) + "/schedules", 303)
    sample, data = await _schedule_data(request)
    return await _html(request, "schedule.html", sample, data)


async def schedule_api(request: Request) -> Response:
    sample, data = await _schedule_data(request)
    return _json(sample, data)


async def static(request: Request) -> Response:
    name = request.path_params["file"]
    types = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
    if name not in types:
        raise HTTPException(404, f"no static file {name!r}")
    return Response(static_file(name), media_type=types[name],
                    headers={"Cache-Control": "public, max-age=300"})


# -- errors ---------------------------------------------------------------------------------

async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(request, exc.status_code, exc.detail, exc.headers)


async def database_error(request: Request, exc: Exception) -> Response:
    # The database refused or could not be reached (a timeout, a lock, a restart): the
    # page says so, as for a sample that cannot be read; not the dashboard's bug.
    log.warning("pgcoord.web: %s %s: %s", request.method, request.url.path, exc)
    return _error(request, 503, str(exc))


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("pgcoord.web: %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(request, 500, f"the dashboard failed: {type(exc).__name__} (details in the server's log)")


def _error(request: Request, status: int, detail: str, headers: Any = None) -> Response:
    path = request.url.path[len(base_of(request)):]
    if path.startswith("/api") or "application/json" in request.headers.get("accept", ""):
        return JSONResponse({"error": detail, "status": status}, status_code=status, headers=headers)
    body = render("error.html", layout="base.html", base=base_of(request), path=path, pages=PAGES,
                  status=status, detail=detail, sample=None)
    return HTMLResponse(body, status_code=status, headers=headers)


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
        HTTPException: http_error, DatabaseError: database_error, Exception: server_error,
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
