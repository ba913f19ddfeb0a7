"""``pgcoord web``: serve the operators' dashboard (docs/web.md) with uvicorn.

    pgcoord web --dsn URL [--host 127.0.0.1] [--port 8765] [--read-only]

It binds to 127.0.0.1 unless told otherwise. On any other address it needs basic
auth (PGCOORD_WEB_USER and PGCOORD_WEB_PASSWORD) or --read-only, and refuses to
start without one of them. Without --read-only every action is allowed: pause,
resume and trigger a schedule, ask a leader to resign.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import sys
from typing import Any

from .errors import EXIT_USAGE, CliError, check_number, libpq_dsn

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765


def add_parser(sub: Any, parents: list[argparse.ArgumentParser], dsn_default: str | None,
               epilog: str) -> None:
    web = sub.add_parser("web", parents=parents, help="serve the operators' dashboard",
                         description=__doc__, epilog=epilog,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    web.add_argument("--dsn", default=dsn_default,
                     help="database URL or key=value string (default $PGCOORD_DSN, then $DATABASE_URL)")
    web.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    web.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    web.add_argument("--read-only", action="store_true",
                     help="refuse every action (pause, resume, trigger, resign)")
    web.set_defaults(func=run_web)


def is_loopback(host: str) -> bool:
    """Only addresses that are loopback for certain: a host name other than
    localhost may resolve anywhere, so it counts as public."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run_web(args: argparse.Namespace) -> int:
    from .main import _require_dsn

    dsn = libpq_dsn(_require_dsn(args))
    check_number(args.port, "--port", minimum=1, maximum=65535, integer=True)
    try:
        import uvicorn

        import pgcoord.web
        from pgcoord.web.security import PASSWORD_ENV, USER_ENV, basic_auth_from_env
    except ImportError as exc:
        raise CliError(EXIT_USAGE, f"pgcoord web needs the web extra ({exc.name} is missing): "
                                   "pip install 'pgcoord[web]'") from exc
    try:
        basic = basic_auth_from_env()
    except ValueError as exc:
        raise CliError(EXIT_USAGE, str(exc)) from exc
    if basic is None and not args.read_only and not is_loopback(args.host):
        raise CliError(EXIT_USAGE, f"refusing to serve on {args.host}, which is not a loopback address, "
                                   f"with neither basic auth ({USER_ENV}, {PASSWORD_ENV}) nor --read-only")
    app = pgcoord.web.app(dsn, access=None if args.read_only else (lambda request: "all"))
    shown = f"[{args.host}]" if ":" in args.host else args.host
    mode = "read-only" if args.read_only else "actions allowed"
    print(f"pgcoord web: http://{shown}:{args.port}/ ({mode}; basic auth {'on' if basic else 'off'}); "
          "Ctrl-C to stop", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=5)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the Ctrl-C it held again
        _server_class()(app, config).run()
    return 0


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn waits for open responses before it stops, and an open page's event
        stream never ends on its own: told to stop, the server ends them first."""

        def __init__(self, app: Any, config: uvicorn.Config) -> None:
            super().__init__(config)
            self._dashboard = app.state.pgcoord_dashboard
            self._loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._dashboard.end_streams)

    return Server
