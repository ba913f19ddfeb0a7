"""The dashboard beside a Django project, in one ASGI app (docs/web.md).

Django has no mount for other ASGI apps; its ASGI entry point is a callable like any
other, so the project's asgi.py sends /pgcoord/ to the dashboard and the rest to
Django. Run it with ``uvicorn examples.recipes.django_asgi:app`` (PGCOORD_DSN set).
"""

from __future__ import annotations

import os
from typing import Any

PREFIX = "/pgcoord"


def configure(dsn: str | None = None) -> None:
    """A minimal Django settings module, for this example (a project has its own)."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DEBUG=False, ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__,
                           SECRET_KEY="example-only", PGCOORD_DSN=dsn or os.environ.get("PGCOORD_DSN"))
        django.setup()


def hello(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("hello from django")


def _urls() -> list[Any]:
    from django.urls import path

    return [path("hello/", hello)]


def __getattr__(name: str) -> Any:
    if name == "urlpatterns":  # Django reads ROOT_URLCONF's urlpatterns lazily
        return _urls()
    if name == "app":
        configure()
        return application()
    raise AttributeError(name)


def application() -> Any:
    """The project's ASGI app: the dashboard under PREFIX, Django for the rest."""
    from django.conf import settings
    from django.core.asgi import get_asgi_application

    import pgcoord.web

    django_app = get_asgi_application()
    dashboard = pgcoord.web.app(settings.PGCOORD_DSN, access=None)

    async def route(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and (path == PREFIX or path.startswith(PREFIX + "/")):
            # As Starlette's Mount does: the prefix moves to root_path, the path is kept whole.
            scope = {**scope, "root_path": scope.get("root_path", "") + PREFIX}
            await dashboard(scope, receive, send)
        elif scope["type"] == "lifespan":
            await dashboard(scope, receive, send)  # Django has no lifespan; the dashboard's closes its pool
        else:
            await django_app(scope, receive, send)

    return route
