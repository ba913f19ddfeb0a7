"""``pgcoord doctor``: checks a deployment against what pgcoord relies on (docs/operations.md).

Each check is data, a :class:`Check` (name, status ``pass``/``warn``/``fail``, what was
found, and one line saying what to do), so the command can print them as a table or as
JSON and tests can read them. ``run_checks()`` never raises for what it finds: a
database it cannot reach is a failed ``connect`` check, not a traceback.

The exit status is the worst status: 0 every check passed, 1 a warning, 2 a failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from .._core.queries import parse
from .._core.resources import migrations_dir, read_sql
from .._drivers.dedicated import DsnSource, behind_transaction_pooler
from .._drivers.dsn import OPERATOR
from .._drivers.protocol import DedicatedSession

PASS, WARN, FAIL = "pass", "warn", "fail"
EXIT_STATUS = {PASS: 0, WARN: 1, FAIL: 2}

MIN_SERVER, NEWEST_TESTED = 140000, 18  # PostgreSQL 14 .. 18 (CONTRIBUTING.md, supported versions)
SKEW_WARN, SKEW_FAIL = 1.0, 30.0  # seconds between this host's clock and the server's
# Seconds a standby's clock may be ahead of the primary's: after a failover it expires
# leases that much early. A leader's trust window ends 10% of its ttl (at most 1 s)
# before expiry, so past 1 s two leaders can overlap whatever the ttl.
STANDBY_AHEAD_WARN, STANDBY_AHEAD_FAIL = 0.1, 1.0
LOCKS_WARN = 0.5  # of the lock table: advisory locks share it with every other lock
CONNECTIONS_WARN = 0.8  # of the connection slots a non-superuser may take


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, WARN or FAIL
    detail: str  # what was found
    fix: str = ""  # one line, for a warning or a failure

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def exit_status(checks: list[Check]) -> int:
    return max((EXIT_STATUS[c.status] for c in checks), default=0)


@cache
def _q(name: str) -> str:
    return parse(read_sql("doctor_queries.sql"))[name]


def _head() -> str:
    """The newest revision this pgcoord ships, without Alembic if need be (revisions
    are numbered files: 0001_foundation.py ...)."""
    if importlib.util.find_spec("alembic") is not None:
        from ..migrations import head

        return head()
    numbers = (re.match(r"(\d{4})_", p.name) for p in (migrations_dir() / "versions").glob("*.py"))
    return max(m.group(1) for m in numbers if m)


_SERVICE_GRANT = re.compile(
    r"^GRANT\s+(?P<privileges>[\w\s,]+?)\s+ON\s+(?:(?P<kind>SCHEMA|SEQUENCE|TABLE)\s+)?"
    r"(?P<objects>[\w.,\s]+?)\s+TO\s+pgcoord_service\s*;", re.IGNORECASE | re.MULTILINE)


@cache
def service_grants() -> tuple[list[str], list[str], list[str]]:
    """sql/roles.sql's grants to the service role, as (kinds, objects, privileges):
    read from the file itself, so that a grant added there is checked here too."""
    kinds, objects, privileges = [], [], []
    for m in _SERVICE_GRANT.finditer(read_sql("roles.sql")):
        for obj in (o.strip() for o in m["objects"].split(",")):
            for privilege in (p.strip().upper() for p in m["privileges"].split(",")):
                kinds.append((m["kind"] or "table").lower())
                objects.append(obj)
                privileges.append(privilege)
    return kinds, objects, privileges


# -- the checks, each on what the server told ---------------------------------------------

def check_version(num: int, text: str) -> Check:
    if num < MIN_SERVER:
        return Check("server_version", FAIL, f"PostgreSQL {text}",
                     "pgcoord needs PostgreSQL 14 or newer: upgrade the server")
    if num // 10000 > NEWEST_TESTED:
        return Check("server_version", WARN, f"PostgreSQL {text}, newer than any pgcoord is tested on "
                     f"(14 to {NEWEST_TESTED})", "run pgcoord's test suite against it, or report an issue")
    return Check("server_version", PASS, f"PostgreSQL {text}")


def check_schema(installed: bool, readable: bool, version: str | None, head: str) -> Check:
    if not installed:
        return Check("schema", FAIL, "pgcoord's schema is not installed",
                     "install it: pgcoord migrate --dsn ... (as the database's owner)")
    if not readable:
        return Check("schema", WARN, "this role may not read pgcoord.alembic_version",
                     "run doctor as the schema's owner to check the revision")
    if version == head:
        return Check("schema", PASS, f"at head ({head})")
    return Check("schema", FAIL, f"at revision {version or 'none'}, this pgcoord's head is {head}",
                 "upgrade it: pgcoord migrate --dsn ... (or upgrade the pgcoord package, "
                 "if the database is ahead)")


def check_privileges(role: str, superuser: bool | None, missing: str | None) -> Check:
    if superuser is None:
        return Check("privileges", FAIL, f"there is no role {role}", "check --role")
    if superuser:
        return Check("privileges", PASS, f"{role} is a superuser: it has every privilege "
                     "(pass --role to check a service role)")
    if missing:
        return Check("privileges", FAIL, f"{role} lacks {missing}",
                     "grant them: run sql/roles.sql (as the schema's owner) for this role")
    return Check("privileges", PASS, f"{role} has every grant of sql/roles.sql's service role")


def check_locks(capacity: int, in_use: int, expected: int) -> Check:
    need = max(in_use, expected)
    detail = (f"lock table of {capacity} slots (max_locks_per_transaction x connections); "
              f"{in_use} advisory locks now" + (f", {expected} expected" if expected else ""))
    fix = "raise max_locks_per_transaction (a restart), or hold fewer session locks at once"
    if need >= capacity:
        return Check("lock_headroom", FAIL, detail, fix)
    if need > LOCKS_WARN * capacity:
        return Check("lock_headroom", WARN, detail + f": over {LOCKS_WARN:.0%}", fix)
    return Check("lock_headroom", PASS, detail)


def check_connections(max_conn: int, reserved: int, in_use: int, expected: int) -> Check:
    usable = max_conn - reserved
    need = in_use + expected
    detail = (f"{in_use} client connections of {usable} usable (max_connections {max_conn}, "
              f"{reserved} reserved)" + (f", {expected} more expected" if expected else ""))
    fix = ("raise max_connections, or give each process one Member (2 connections for all "
           "its electors, locks and claims) and smaller pools")
    if need >= usable:
        return Check("connections", FAIL, detail, fix)
    if need > CONNECTIONS_WARN * usable:
        return Check("connections", WARN, detail + f": over {CONNECTIONS_WARN:.0%}", fix)
    return Check("connections", PASS, detail)


def check_replication(in_recovery: bool, standbys: int, synchronous: int, unknown: int,
                      sync_commit: str, sync_names: str = "", others: str = "",
                      quorum: int = 0) -> Check:
    """``others``: the standbys commits do not wait for, by name; ``quorum``: how many
    are in a quorum (ANY n), of which a commit waits for only some."""
    if in_recovery:
        return Check("replication", FAIL, "connected to a standby (read-only): pgcoord cannot write here",
                     "list every server in the DSN with target_session_attrs=read-write")
    if sync_names.strip() and synchronous == 0 and not unknown:
        # Every commit that writes waits for a synchronous standby that is not there.
        return Check("replication", FAIL,
                     f"synchronous_standby_names is {sync_names!r} but no such standby is streaming "
                     f"({standbys} connected): every commit that writes waits until one is",
                     "start the standby, or empty synchronous_standby_names until it is back")
    if standbys == 0:
        return Check("replication", PASS, "no streaming standbys")
    if unknown:
        return Check("replication", WARN, f"{standbys} standbys; this role may not see their sync state",
                     "run doctor as a role with pg_monitor")
    if synchronous == 0:
        return Check("replication", WARN,
                     f"{standbys} standbys, all asynchronous: on failover a lease, a takeover or "
                     "a fence can go back by the replication lag",
                     "name a standby in synchronous_standby_names (and keep synchronous_commit on)")
    if sync_commit in ("off", "local"):
        return Check("replication", WARN, f"synchronous standby present, but synchronous_commit is "
                     f"{sync_commit}: commits do not wait for it",
                     "set synchronous_commit = on (or remote_apply) for pgcoord's role")
    promote_fix = ("promote only a standby that has every commit: a synchronous one, or the one "
                   "that received the most WAL (pg_last_wal_receive_lsn())")
    if others:
        return Check("replication", WARN,
                     f"{standbys} standbys, {synchronous} synchronous; commits do not wait for "
                     f"{others}: promoting one of those can take a lease or a fence back", promote_fix)
    if quorum:
        return Check("replication", WARN,
                     f"{standbys} standbys in a quorum (synchronous_standby_names {sync_names!r}): "
                     "a commit waits for only some of them, and promoting another can take a "
                     "lease or a fence back", promote_fix)
    return Check("replication", PASS, f"{standbys} standbys, {synchronous} synchronous")


def check_standby_clock(standby: str | None, ahead: float | None) -> Check | None:
    """``ahead``: seconds the clock of ``standby`` (the one furthest ahead) is ahead
    of the primary's; None when no standby's reply time is seen (no check)."""
    if standby is None or ahead is None:
        return None
    if ahead <= 0:
        return Check("standby_clock", PASS, f"no standby's clock is ahead of this server's "
                                             f"(latest reply from {standby})")
    detail = (f"the clock of standby {standby} is at least {ahead:.3f} s ahead of this server's: "
              "promoted, it would let leases be taken over that much before their holders "
              "stop believing")
    fix = "run NTP (chrony, systemd-timesyncd) on every server, synchronised to the same sources"
    if ahead >= STANDBY_AHEAD_FAIL:
        return Check("standby_clock", FAIL, detail, fix)
    if ahead >= STANDBY_AHEAD_WARN:
        return Check("standby_clock", WARN, detail, fix)
    return Check("standby_clock", PASS, f"standby {standby} is {ahead:.3f} s ahead (within "
                                        f"{STANDBY_AHEAD_WARN} s)")


def check_synchronous_commit(value: str, for_role: str | None = None) -> Check:
    """``for_role``: the role whose own setting ``value`` is (ALTER ROLE ... SET)."""
    said = value if for_role is None else f"{value} (set for role {for_role})"
    if value == "off":
        return Check("synchronous_commit", WARN,
                     f"{said}: a crash can lose acknowledged lease takeovers and fences",
                     f"ALTER ROLE {for_role or '<service role>'} SET synchronous_commit = on")
    return Check("synchronous_commit", PASS, said)


def check_clock(skew: float) -> Check:
    detail = f"this host's clock is {abs(skew):.3f} s {'ahead of' if skew > 0 else 'behind'} the server's"
    fix = "run NTP (chrony, systemd-timesyncd) on both hosts"
    if abs(skew) >= SKEW_FAIL:
        return Check("clock_skew", FAIL, detail, fix)
    if abs(skew) >= SKEW_WARN:
        return Check("clock_skew", WARN, detail + " (pgcoord decides by the server's clock; "
                     "logs and job times will disagree)", fix)
    return Check("clock_skew", PASS, detail)


def check_pooler(pooled: bool, transaction_mode: bool) -> Check:
    if transaction_mode:
        return Check("pooler", WARN, "a transaction-mode pooler is in between: LockHolder is refused, "
                     "electors and members fall back to polling",
                     "give Member, Elector and LockHolder a direct DSN (or a session-mode pool)")
    if pooled:
        return Check("pooler", PASS, "a session-mode pooler is in between")
    return Check("pooler", PASS, "direct to the server")


# -- running them ---------------------------------------------------------------------------

async def _gather(conn: DedicatedSession, source: DsnSource, *, locks: int, connections: int,
                  role: str | None, clock: Callable[[], float]) -> list[Check]:
    sent = clock()
    num, version, in_recovery, pid, sync_commit, server_now, user = await conn.fetchrow(  # type: ignore[misc]
        _q("doctor_server"))
    skew = (sent + clock()) / 2 - float(server_now)
    checks = [check_version(int(num), str(version))]
    installed, readable = await conn.fetchrow(_q("doctor_schema_installed"))  # type: ignore[misc]
    schema_version = await conn.fetchval(_q("doctor_schema_version")) if readable else None
    checks.append(check_schema(bool(installed), bool(readable), schema_version, _head()))
    role = role or str(user)
    # The role's own setting, if it has one: the session doctor runs in may be another
    # role's (an operator checking the service role with --role).
    role_sync = await conn.fetchval(_q("doctor_role_synchronous_commit"), role)
    sync_role = None if role_sync is None else role
    sync_commit = sync_commit if role_sync is None else role_sync
    if installed:
        superuser, missing = await conn.fetchrow(_q("doctor_missing_privileges"), role,  # type: ignore[misc]
                                                 *service_grants())
        checks.append(check_privileges(role, superuser, missing))
    capacity, advisory, max_conn, reserved, clients = await conn.fetchrow(_q("doctor_capacity"))  # type: ignore[misc]
    checks.append(check_locks(int(capacity), int(advisory), locks))
    checks.append(check_connections(int(max_conn), int(reserved), int(clients), connections))
    standbys, synchronous, unknown, sync_names, others, quorum, latest, ahead = await conn.fetchrow(  # type: ignore[misc]
        _q("doctor_standbys"))
    checks.append(check_replication(bool(in_recovery), int(standbys), int(synchronous), int(unknown),
                                    str(sync_commit), str(sync_names or ""), str(others), int(quorum)))
    standby_clock = check_standby_clock(latest, None if ahead is None else float(ahead))
    if standby_clock is not None:
        checks.append(standby_clock)
    checks.append(check_synchronous_commit(str(sync_commit), sync_role))
    checks.append(check_clock(skew))
    conn.backend_pid = int(pid)
    pooled = conn.announced_pid() != conn.backend_pid
    checks.append(check_pooler(pooled, pooled and await behind_transaction_pooler(source, conn)))
    return checks


async def run_checks_async(dsn: str, *, locks: int = 0, connections: int = 0, role: str | None = None,
                           clock: Callable[[], float] = time.time, patroni: Sequence[str] = (),
                           ttl: float | None = None) -> list[Check]:
    """Every check against ``dsn``. ``locks``: the advisory locks the deployment holds at
    its peak; ``connections``: the connections it will open beyond those open now;
    ``role``: whose privileges to check (default: the role connected); ``patroni``:
    Patroni REST API URLs to check too (doctor_patroni.py), against ``ttl`` (default:
    the ttls of the leases held now)."""
    ttls: list[tuple[float, float]] = []
    checks = await _database_checks(dsn, locks=locks, connections=connections, role=role, clock=clock,
                                    lease_ttls=ttls if patroni and ttl is None else None)
    if patroni:
        from .doctor_patroni import patroni_checks

        found = (ttl, ttl) if ttl is not None else (ttls[0] if ttls else None)
        checks += await asyncio.to_thread(patroni_checks, list(patroni), found)
    return checks


async def _database_checks(dsn: str, *, locks: int, connections: int, role: str | None,
                           clock: Callable[[], float],
                           lease_ttls: list[tuple[float, float]] | None) -> list[Check]:
    from .errors import CONNECT_TIMEOUT, describe, explain, libpq_dsn

    try:  # a DSN no installed driver reads is a connect failure too
        # An operator's command: psycopg (libpq) first, see _drivers/dsn.py.
        source = DsnSource(libpq_dsn(dsn), None, keepalive=10.0, prefer=OPERATOR,
                           connect_timeout=CONNECT_TIMEOUT)
        conn = await source.open()
    except Exception as exc:
        failure = explain(exc, dsn)
        return [Check("connect", FAIL, failure.message, "check --dsn, and that the server is up")]
    checks = [Check("connect", PASS, f"connected to {describe(dsn)}")]
    try:
        await conn.prepare()
        checks += await _gather(conn, source, locks=locks, connections=connections, role=role,
                                clock=clock)
        if lease_ttls is not None and any(c.name == "schema" and c.status == PASS for c in checks):
            low, high = await conn.fetchrow(_q("doctor_lease_ttls"))  # type: ignore[misc]
            if low is not None:
                lease_ttls.append((float(low), float(high)))
        return checks
    except Exception as exc:  # a check that could not run is a failure, not a traceback
        return [*checks, Check("doctor", FAIL, f"a check could not run: {explain(exc, dsn).message}",
                               "fix that, then run doctor again")]
    finally:
        await conn.close_now()


def run_checks(dsn: str, **options: Any) -> list[Check]:
    return asyncio.run(run_checks_async(dsn, **options))


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():4}  {c.name:<{width}}  {c.detail}")
        if c.status != PASS and c.fix:
            lines.append(f"{'':4}  {'':<{width}}  fix: {c.fix}")
    worst = exit_status(checks)
    lines.append({0: "all checks passed", 1: "warnings: see fix", 2: "failures: see fix"}[worst])
    return "\n".join(lines)


__all__ = ["Check", "check_clock", "exit_status", "format_checks", "run_checks", "run_checks_async"]


# -- the command ----------------------------------------------------------------------------

DOCTOR_EPILOG = """exit status:
  0    every check passed
  1    a warning (and no failure): each says what to do
  2    a failure: a check failed, the database could not be reached, or a bad option
  130  interrupted"""


def add_parser(sub: Any, parents: list[Any], default_dsn: str | None) -> None:
    """``pgcoord doctor``, for ``cli.build_parser()``."""
    import argparse

    doctor = sub.add_parser("doctor", parents=parents, help="check a deployment (docs/operations.md)",
                            epilog=DOCTOR_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--dsn", default=default_dsn,
                        help="database URL or key=value string, multi-host allowed "
                             "(default $PGCOORD_DSN, then $DATABASE_URL)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.add_argument("--locks", type=int, default=0, metavar="N",
                        help="advisory locks the deployment holds at its peak (default: those held now)")
    doctor.add_argument("--connections", type=int, default=0, metavar="N",
                        help="connections the deployment will open beyond those open now")
    doctor.add_argument("--role", default=None,
                        help="check this role's privileges (default: the role connected)")
    doctor.add_argument("--patroni", action="append", default=[], metavar="URL",
                        help="also check the Patroni cluster whose REST API is at URL "
                             "(http://host:8008); repeatable")
    doctor.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                        help="pgcoord's shortest ttl, to compare with Patroni's failover time "
                             "(default: the ttls of the leases held now)")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: Any) -> int:
    import json

    from .._core.checks import INT4_MAX
    from .errors import EXIT_USAGE, CliError, check_dsn, check_number, explain

    if not args.dsn:
        raise CliError(EXIT_USAGE, "no database given: pass --dsn postgresql://user@host/dbname "
                                   "or set PGCOORD_DSN")
    if args.locks < 0 or args.connections < 0:
        raise CliError(EXIT_USAGE, "--locks and --connections take a number >= 0")
    check_number(args.locks, "--locks", minimum=0, maximum=INT4_MAX, integer=True)
    check_number(args.connections, "--connections", minimum=0, maximum=INT4_MAX, integer=True)
    if args.ttl is not None:
        check_number(args.ttl, "--ttl", minimum=0.001, maximum=INT4_MAX)
    dsn = check_dsn(str(args.dsn))
    try:
        checks = run_checks(dsn, locks=args.locks, connections=args.connections, role=args.role,
                            patroni=args.patroni, ttl=args.ttl)
    except Exception as exc:
        # main() would exit 1 (EXIT_ERROR), which for doctor means "a warning": a doctor
        # that could not run at all is a failure (2), still in one line.
        raise CliError(EXIT_STATUS[FAIL], explain(exc, dsn).message) from exc
    if args.json:
        print(json.dumps({"status": exit_status(checks),
                          "checks": [c.as_dict() for c in checks]}, indent=2))
    else:
        print(format_checks(checks))
    return exit_status(checks)
