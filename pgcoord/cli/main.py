"""The ``pgcoord`` command: ``migrate``, ``status``, ``doctor``, ``demo``, ``jobs`` and ``web``."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from .errors import (
    EXIT_BROKEN_PIPE,
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_SCHEMA,
    EXIT_USAGE,
    CliError,
    check_dsn,
    check_number,
    explain,
    with_connect_timeout,
)


def _default_dsn() -> str | None:
    return os.environ.get("PGCOORD_DSN") or os.environ.get("DATABASE_URL")


def _require_dsn(args: argparse.Namespace, *, url_only: bool = False) -> str:
    if not args.dsn:
        raise CliError(EXIT_USAGE, "no database given: pass --dsn postgresql://user@host/dbname "
                                   "or set PGCOORD_DSN")
    return check_dsn(str(args.dsn), url_only=url_only)


def _check_revision(revision: str) -> None:
    """Refuse a revision this pgcoord does not ship before connecting anywhere."""
    from alembic.script import ScriptDirectory

    from .. import migrations
    from .._core.resources import migrations_dir

    if any(c in revision for c in "+-@:") or revision in ("head", "heads", "base"):
        return  # relative and ranged forms: Alembic checks them against the database
    try:
        ScriptDirectory(str(migrations_dir())).get_revision(revision)
    except Exception as exc:  # alembic's CommandError / ResolutionError
        raise CliError(EXIT_USAGE, f"unknown revision {revision!r}: this pgcoord has "
                                   f"{', '.join(migrations.revisions())} (or head, base)") from exc


def cmd_migrate(args: argparse.Namespace) -> int:
    from .. import migrations

    target_revision = args.downgrade or args.revision
    _check_revision(target_revision)
    if args.sql:
        # Offline mode needs only a dialect; the URL is never connected to.
        target = "postgresql://offline/pgcoord"
        if args.downgrade:
            migrations.downgrade(target, args.downgrade, sql=True)
        else:
            migrations.upgrade(target, args.revision, sql=True)
        return 0
    dsn = with_connect_timeout(_require_dsn(args, url_only=True))
    before = migrations.current(dsn)
    if before is not None and before not in migrations.revisions():
        raise CliError(EXIT_SCHEMA, f"the database's pgcoord schema is at revision {before}, which "
                                    f"this pgcoord (head {migrations.head()}) does not know: "
                                    f"upgrade the pgcoord package")
    if args.downgrade:
        if before is None:
            # Running the environment would create the schema just to remove it.
            print("pgcoord schema not installed: nothing to do")
            return 0
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

    if args.watch is not None:
        check_number(args.watch, "--watch", minimum=0.01, maximum=86400)
    dsn = _require_dsn(args)
    return run_status(dsn, watch=args.watch, as_json=args.json,
                      explain=lambda exc: str(explain(exc, dsn)))


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(check_dsn(args.dsn) if args.dsn else None)


def _exit_codes_epilog() -> str:
    lines = ["exit codes:"] + [f"  {code:<3}  {meaning}" for code, meaning in EXIT_CODES]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (and exit 2) like every other mistake."""

    def error(self, message: str) -> NoReturn:
        print(f"pgcoord: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command; the subcommand's copy
    # defaults to SUPPRESS so it never overwrites the one given before.
    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on failure, print the traceback as well")
    parser = _Parser(
        prog="pgcoord", description=__doc__, epilog=_exit_codes_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="on failure, print the traceback as well")
    sub = parser.add_subparsers(dest="command", required=True)

    migrate = sub.add_parser("migrate", parents=[debug], help="install or upgrade pgcoord's schema",
                             epilog=_exit_codes_epilog(),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    migrate.add_argument("--dsn", default=_default_dsn(),
                         help="database URL, postgresql://user:password@host:port/dbname "
                              "(default $PGCOORD_DSN, then $DATABASE_URL)")
    migrate.add_argument("--sql", action="store_true", help="print the DDL instead of running it")
    migrate.add_argument("--revision", default="head", help="target revision (default head)")
    migrate.add_argument("--downgrade", metavar="REV",
                         help="downgrade to REV instead; 'base' removes every pgcoord object")
    migrate.set_defaults(func=cmd_migrate)

    status = sub.add_parser("status", parents=[debug], help="show who holds what (pgcoord.holders)",
                            epilog=_exit_codes_epilog(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_argument("--dsn", default=_default_dsn(),
                        help="database URL or key=value string (default $PGCOORD_DSN, then $DATABASE_URL)")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                        metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C")
    status.add_argument("--json", action="store_true", help="print rows as JSON")
    status.set_defaults(func=cmd_status)

    from .doctor import add_parser as add_doctor_parser

    add_doctor_parser(sub, [debug], _default_dsn())

    demo = sub.add_parser("demo", parents=[debug], help="show pgcoord working on a throwaway PostgreSQL")
    demo.add_argument("--dsn", default=None,
                      help="use this database instead of starting a throwaway server")
    demo.set_defaults(func=cmd_demo)

    from .jobs import add_parser as add_jobs_parser

    add_jobs_parser(sub, [debug], _default_dsn(), _exit_codes_epilog())

    from .web import add_parser as add_web_parser

    add_web_parser(sub, [debug], _default_dsn(), _exit_codes_epilog())
    return parser


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's last flush, after a
    reader such as ``head`` went away, does not print a BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; one line on stderr and a distinct exit code on failure."""
    args = build_parser().parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
        return result
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        failure = explain(exc, getattr(args, "dsn", None))
        if args.debug:
            traceback.print_exception(exc)
        print(f"pgcoord: {failure.message}", file=sys.stderr)
        return failure.code


if __name__ == "__main__":
    sys.exit(main())
