"""The actions: pause, resume, trigger a schedule; ask a leader to resign. Form
POSTs with a CSRF token, gated by ``access``, each logged with who asked."""

from __future__ import annotations

import logging
from urllib.parse import parse_qs

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from .._core.errmap import sqlstate
from .._core.queries import query
from ..leases.statements import validate_name
from .dashboard import Dashboard, base_of, check_name, dashboard_of, who
from .security import ACTIONS, CSRF_COOKIE, CSRF_FIELD, allowed_actions

log = logging.getLogger("pgcoord.web")

#: Bytes an action's form may take.
FORM_MAX = 16384
INSUFFICIENT_PRIVILEGE = "42501"


async def action(request: Request) -> Response:
    dash = dashboard_of(request)
    verb = request.path_params["action"]
    if verb not in ACTIONS:
        raise HTTPException(404, f"no action {verb!r}: the actions are {', '.join(ACTIONS)}")
    form = await _form(request)
    name = check_name(str(form.get("name") or ""), "lease" if verb == "resign" else "schedule")
    by = who(request)
    if not dash.csrf.valid(request.cookies.get(CSRF_COOKIE), str(form.get(CSRF_FIELD) or "")):
        _audit(verb, name, by, "refused: bad CSRF token")
        raise HTTPException(403, "CSRF check failed: the form's token does not match this browser's "
                                 "cookie (reload the page and try again; several worker processes "
                                 "need the same PGCOORD_WEB_SECRET)")
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
    base = base_of(request)
    if target.startswith((base + "/") if base else "/") and not target.startswith("//") \
            and "\\" not in target and "\r" not in target and "\n" not in target:
        return target
    return base + "/"
