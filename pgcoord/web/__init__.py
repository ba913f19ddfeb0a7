"""pgcoord.web: the operators' dashboard, an ASGI app (``pip install 'pgcoord[web]'``).

    app = pgcoord.web.app(dsn_or_pool, access=None)
    fastapi_app.mount("/pgcoord", app)

See docs/web.md.
"""

from __future__ import annotations

try:
    import jinja2 as _jinja2  # noqa: F401
    import starlette as _starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(f"pgcoord.web needs the web extra ({exc.name} is missing): "
                      "pip install 'pgcoord[web]'") from exc

from .application import aclose, app
from .security import ACTIONS

__all__ = ["ACTIONS", "aclose", "app"]
