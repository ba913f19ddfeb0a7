"""The ``pgcoord`` command: ``migrate``, ``status`` and ``demo``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _default_dsn() -> str | None:
    return os.environ.get("PGCOORD_DSN") or os.environ.get("DATABASE_URL")


def _require_dsn(args: argparse.Namespace) -> str:
    if not args.dsn:
        raise SystemExit("pgcoord: no database given: pass --dsn or set PGCOORD_DSN")
    return str(args.dsn)


def cmd_migrate(args: argparse.Namespace) -> int:
    from . import migrations

    if args.sql:
        # Offline mode needs only a dialect; the URL is never connected to.
        target = args.dsn or "postgresql://offline/pgcoord"
        if args.downgrade:
            migrations.downgrade(target, args.downgrade, sql=True)
        else:
            migrations.upgrade(target, args.revision, sql=True)
        return 0
    dsn = _require_dsn(args)
    before = migrations.current(dsn)
    if args.downgrade:
        migrations.downgrade(dsn, args.downgrade)
    else:
        migrations.upgrade(dsn, args.revision)
    after = migrations.current(dsn)
    if before == after:
        print(f"pgcoord schema already at {after or 'base'}: nothing to do")
    else:
        print(f"pgcoord schema: {before or 'base'} -> {after or 'base'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .status import run_status

    return run_status(_require_dsn(args), watch=args.watch, as_json=args.json)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.dsn)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgcoord", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    migrate = sub.add_parser("migrate", help="install or upgrade pgcoord's schema")
    migrate.add_argument("--dsn", default=_default_dsn(), help="database URL (default $PGCOORD_DSN)")
    migrate.add_argument("--sql", action="store_true", help="print the DDL instead of running it")
    migrate.add_argument("--revision", default="head", help="target revision (default head)")
    migrate.add_argument("--downgrade", metavar="REV",
                         help="downgrade to REV instead; 'base' removes every pgcoord object")
    migrate.set_defaults(func=cmd_migrate)

    status = sub.add_parser("status", help="show who holds what (pgcoord.holders)")
    status.add_argument("--dsn", default=_default_dsn())
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                        metavar="SECONDS", help="refresh every SECONDS (default 2)")
    status.add_argument("--json", action="store_true", help="print rows as JSON")
    status.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="show pgcoord working on a throwaway PostgreSQL")
    demo.add_argument("--dsn", default=None,
                      help="use this database instead of starting a throwaway server")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
