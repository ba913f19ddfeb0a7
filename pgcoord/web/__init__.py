"""pgcoord.web: the operators' dashboard, an ASGI app (``pip install 'pgcoord[web]'``).

    app = pgcoord.web.app(dsn_or_pool, access=None)
    fastapi_app.mount("/pgcoord", app)

See docs/web.md.
"""

from __future__ import annotations

from .application import aclose, app
from .security import ACTIONS

__all__ = ["ACTIONS", "aclose", "app"]
