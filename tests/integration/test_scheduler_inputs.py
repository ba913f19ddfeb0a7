"""Issue 22 §3: every input of the Scheduler's public surface is checked at the call.

A value the database cannot store or the loop cannot use (NaN, infinity, a
duration beyond any interval, text with a NUL character, an integer beyond a
column's range, args jsonb refuses) gets a ``ValueError`` (or ``TypeError`` for
a wrong type) where it is given: never a driver error, never a tick that fails
for ever in the background. And the loop's lifecycle: a ``stop()`` before
``run()`` sticks; a schedule written badly through SQL is flagged, skipped and
repairable, and hides no other schedule.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgcoord.scheduler import Scheduler, Slot

from .conftest import sql, unique

UTC = dt.UTC
ROOT = Path(__file__).resolve().parents[2]
NAN, INF = float("nan"), float("inf")
#: Durations no interval or timestamp arithmetic of the database can hold.
HUGE = 1e300


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    yield p
    await p.close()


def schedule_rows(dsn: str, name: str) -> list[tuple[Any, ...]]:
    return sql(dsn, "select name from pgcoord.schedules where name = %s", name)


async def noop(slot: Slot) -> None:
    return None


async def refused(call: Awaitable[Any] | Callable[[], Any],
                  exc: type[Exception] | tuple[type[Exception], ...] = ValueError) -> str:
    """The message of the ``exc`` the call raises (no driver error, nothing else)."""
    with pytest.raises(exc) as info:
        result = call() if callable(call) else call
        if asyncio.iscoroutine(result):
            await result
    assert "asyncpg" not in type(info.value).__module__
    return str(info.value)


# -- numbers of seconds ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [NAN, INF, -INF, HUGE])
async def test_constructor_cron_and_job_refuse_nan_infinity_and_durations_beyond_an_interval(
        pool: asyncpg.Pool, bad: float) -> None:
    await refused(lambda: Scheduler(pool, tick=bad))
    s = Scheduler(pool)
    for option in ("claim_ttl", "jitter", "keep", "timeout", "deadline"):
        await refused(lambda o=option: s.cron(unique("j"), "* * * * *", **{o: bad}))  # type: ignore[misc]
    for option in ("claim_ttl", "jitter", "keep"):
        await refused(lambda o=option: s.job(unique("h"), **{o: bad}))  # type: ignore[misc]
    assert s.jobs == {}


@pytest.mark.parametrize("bad", [NAN, INF, HUGE])
async def test_add_and_update_refuse_nan_and_infinity_and_write_nothing(
        dsn: str, pool: asyncpg.Pool, bad: float) -> None:
    s = Scheduler(pool)
    name = unique("nan")
    for option in ("timeout", "deadline"):
        await refused(s.add(name, "* * * * *", handler="h", **{option: bad}))
        assert schedule_rows(dsn, name) == []
    await s.add(name, "* * * * *", handler="h")
    for option in ("timeout", "deadline"):
        await refused(s.update(name, **{option: bad}))
    info = {i.name: i for i in await s.schedules()}[name]
    assert info.timeout is None and info.deadline is None


async def test_claim_ttl_nan_was_accepted_and_then_every_tick_failed(
        dsn: str, pool: asyncpg.Pool) -> None:
    # Before: Scheduler.cron(claim_ttl=nan) was accepted; every tick then failed (no job
    # of the replica ran). Now refused at the call; a good job beside it runs.
    s = Scheduler(pool, tick=0.2)
    with pytest.raises(ValueError, match="claim_ttl"):
        s.cron(unique("nan-ttl"), "* * * * * *", claim_ttl=NAN)(noop)
    good = unique("good")
    ran: list[Slot] = []

    @s.cron(good, "* * * * * *")
    async def body(slot: Slot) -> None:
        ran.append(slot)

    task = asyncio.create_task(s.run())
    try:
        for _ in range(200):
            if ran:
                break
            await asyncio.sleep(0.05)
    finally:
        await s.stop()
        await task
    assert ran


@pytest.mark.parametrize("drain", [NAN, -1.0, INF, "5"])
async def test_stop_refuses_a_bad_drain(pool: asyncpg.Pool, drain: Any) -> None:
    s = Scheduler(pool)
    await refused(s.stop(drain=drain))


# -- what the database cannot store -----------------------------------------------------------

async def test_names_with_a_nul_or_beyond_the_index_bound_are_refused_at_every_call(
        dsn: str, pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    nul, long = "a\x00b", "x" * 3000  # a btree entry holds at most ~2700 bytes
    for bad in (nul, long):
        await refused(s.add(bad, "* * * * *", handler="h"))
        await refused(s.add(unique("ok"), "* * * * *", handler=bad))
        await refused(lambda b=bad: s.cron(b, "* * * * *"))  # type: ignore[misc]
        await refused(lambda b=bad: s.job(b))  # type: ignore[misc]
        for call in (s.pause, s.resume, s.remove, s.update, s.trigger):
            await refused(call(bad))
        await refused(s.backfill(bad, dt.datetime(2024, 1, 1, tzinfo=UTC),
                                 dt.datetime(2024, 1, 2, tzinfo=UTC)))
        await refused(s.prune(bad))
        await refused(lambda b=bad: s.next_runs(b))  # type: ignore[misc]
        await refused(lambda b=bad: Scheduler(pool, runner=b))  # type: ignore[misc]
    await refused(s.add(unique("tz"), "* * * * *", handler="h", tz="UTC\x00"))
    await refused(s.add(unique("expr"), "* * * * *\x00", handler="h"))
    name = unique("ok")
    await s.add(name, "* * * * *", handler="h")
    await refused(s.update(name, handler=nul))
    await refused(s.update(name, expr="* * * * *\x00"))
    assert [i.handler for i in await s.schedules() if i.name == name] == ["h"]


@pytest.mark.parametrize("args", [
    {"text": "a\x00b"},                 # jsonb refuses \u0000 in strings
    {"a\x00": 1},                       # and in keys
    ["x", {"deep": ["\x00"]}],
    {"n": NAN}, {"n": INF},            # not JSON
    {"n": 10 ** 5000},                 # beyond Python's int-to-text limit
])
async def test_args_jsonb_cannot_store_are_refused_at_add_and_update(
        dsn: str, pool: asyncpg.Pool, args: Any) -> None:
    s = Scheduler(pool)
    name = unique("args")
    await refused(s.add(name, "* * * * *", handler="h", args=args))
    assert schedule_rows(dsn, name) == []
    await s.add(name, "* * * * *", handler="h", args={"ok": 1})
    await refused(s.update(name, args=args))
    assert [i.args for i in await s.schedules() if i.name == name] == [{"ok": 1}]


async def test_args_that_are_not_json_get_a_type_error(pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    await refused(s.add(unique("obj"), "* * * * *", handler="h", args={"o": object()}), TypeError)


@pytest.mark.parametrize("option,bad", [
    ("max_attempts", 2 ** 31), ("max_attempts", 10 ** 20), ("max_attempts", 0),
])
async def test_integers_beyond_the_column_are_refused(
        dsn: str, pool: asyncpg.Pool, option: str, bad: int) -> None:
    s = Scheduler(pool)
    name = unique("int")
    await refused(s.add(name, "* * * * *", handler="h", **{option: bad}))
    await refused(lambda: s.cron(unique("c"), "* * * * *", **{option: bad}))
    assert schedule_rows(dsn, name) == []


@pytest.mark.parametrize("bad", [0, -1, 2 ** 31, 10 ** 20, 1.5, True])
async def test_prune_next_runs_and_alert_after_refuse_bad_counts(pool: asyncpg.Pool, bad: Any) -> None:
    s = Scheduler(pool)
    job = unique("count")
    s.cron(job, "* * * * *")(noop)
    await refused(s.prune(job, batch=bad), (ValueError, TypeError))
    if bad != 0:  # next_runs(n=0) is an empty list
        await refused(lambda: s.next_runs(job, bad), (ValueError, TypeError))
    await refused(lambda: Scheduler(pool, alert_after=bad), (ValueError, TypeError))


async def test_next_runs_refuses_a_naive_after(pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    job = unique("naive")
    s.cron(job, "* * * * *")(noop)
    await refused(lambda: s.next_runs(job, after=dt.datetime(2024, 1, 1)))
    await refused(lambda: s.next_runs(job, after="2024-01-01"))  # type: ignore[arg-type]


# -- stop() before run() -----------------------------------------------------------------------

async def test_stop_before_run_sticks_run_returns_at_once(pool: asyncpg.Pool) -> None:
    s = Scheduler(pool, tick=0.2)
    ran: list[Slot] = []

    @s.cron(unique("stopped"), "* * * * * *")
    async def body(slot: Slot) -> None:
        ran.append(slot)

    await s.stop()
    await asyncio.wait_for(s.run(), timeout=10)
    assert ran == []


async def test_stop_while_run_is_starting_sticks(pool: asyncpg.Pool) -> None:
    # run() scheduled but not yet started when stop() is called (the usual
    # create_task(run()) then stop() at shutdown): the task ends on its own.
    s = Scheduler(pool, tick=0.2)
    s.cron(unique("starting"), "* * * * * *")(noop)
    task = asyncio.create_task(s.run())
    await s.stop()
    await asyncio.wait_for(task, timeout=10)


# -- a schedule written badly through SQL ----------------------------------------------------

async def test_a_bad_expression_written_through_sql_is_flagged_skipped_and_repairable(
        dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    handler = unique("h")
    bad, good = unique("bad-expr"), unique("good")
    s = Scheduler(pool, tick=0.2)
    ran: dict[str, int] = {}

    @s.job(handler)
    async def body(slot: Slot) -> None:
        ran[slot.job] = ran.get(slot.job, 0) + 1

    await s.add(bad, "* * * * * *", handler=handler)
    await s.add(good, "* * * * * *", handler=handler)
    sql(dsn, "select pgcoord.schedule_update(%s, %s::jsonb)", bad, json.dumps({"expr": "61 * * * *"}))

    # Listed, flagged, and not hiding the others.
    found = {i.name: i for i in await s.schedules()}
    assert found[good].error is None and found[good].next_run_at is not None
    assert found[bad].error is not None and "61" in found[bad].error
    assert found[bad].next_run_at is None

    # The CLI lists every schedule, the bad one marked, and exits 0.
    listing = cli("jobs", "--dsn", dsn)
    assert listing.returncode == 0, listing.stderr
    assert good in listing.stdout and bad in listing.stdout and "invalid" in listing.stdout
    as_json = cli("jobs", "--json", "--dsn", dsn)
    assert as_json.returncode == 0, as_json.stderr
    by_name = {r["name"]: r for r in json.loads(as_json.stdout)}
    assert by_name[bad]["error"] and by_name[good]["error"] is None

    # The loop runs the good one and warns once about the bad one, however many ticks.
    caplog.set_level(logging.WARNING, logger="pgcoord.scheduler")
    task = asyncio.create_task(s.run())
    try:
        for _ in range(300):
            if ran.get(good, 0) >= 3:
                break
            await asyncio.sleep(0.05)
        assert ran.get(good, 0) >= 3 and bad not in ran
        warned = [r for r in caplog.records if bad in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]

        # update() repairs it, and the loop runs it.
        info = await s.update(bad, expr="* * * * * *")
        assert info.error is None and info.next_run_at is not None
        for _ in range(300):
            if ran.get(bad, 0) >= 1:
                break
            await asyncio.sleep(0.05)
        assert ran.get(bad, 0) >= 1
    finally:
        await s.stop()
        await task


async def test_a_bad_zone_written_through_sql_is_flagged_and_update_repairs_it(
        dsn: str, pool: asyncpg.Pool) -> None:
    s = Scheduler(pool)
    name = unique("bad-tz")
    await s.add(name, "0 9 * * *", handler="h")
    sql(dsn, "select pgcoord.schedule_update(%s, %s::jsonb)", name, json.dumps({"tz": "Mars/Base"}))
    info = {i.name: i for i in await s.schedules()}[name]
    assert info.error is not None and "Mars/Base" in info.error
    repaired = await s.update(name, tz="Europe/Berlin")
    assert repaired.error is None and repaired.next_run_at is not None


@pytest.mark.parametrize("field", ["timeout", "deadline"])
@pytest.mark.parametrize("value", ["NaN", "Infinity"])
async def test_a_duration_nan_or_infinite_written_through_sql_is_refused_there(
        dsn: str, pool: asyncpg.Pool, field: str, value: str) -> None:
    # Before: CHECK (timeout > 0) holds for NaN, and the row reached every replica's
    # asyncio timers (slots of other jobs then ran late or not at all).
    s = Scheduler(pool)
    name = unique(f"nan-{field}")
    await s.add(name, "0 9 * * *", handler="h")
    with pytest.raises(psycopg.errors.CheckViolation):
        sql(dsn, "select pgcoord.schedule_update(%s, %s::jsonb)", name, json.dumps({field: value}))
    assert {i.name: i for i in await s.schedules()}[name].error is None


def test_a_stored_duration_nan_or_infinite_is_flagged() -> None:
    from pgcoord.scheduler.schedules import row_error

    for value in ("NaN", "Infinity", float("nan")):
        assert row_error("0 9 * * *", "UTC", timeout=value) is not None
        assert row_error("0 9 * * *", "UTC", deadline=value) is not None
    assert row_error("0 9 * * *", "UTC", timeout=5.0, deadline=60.0) is None


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    drop = ("PGCOORD_DSN", "DATABASE_URL", "PGCONNECT_TIMEOUT", "PGSERVICE")
    env = {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": str(ROOT),
           "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pgcoord.cli", *args], capture_output=True,
                          text=True, timeout=90, env=env, stdin=subprocess.DEVNULL)



# -- the class: every public constructor and call that takes seconds or a stored name --------

@pytest.mark.parametrize("bad", [NAN, INF, HUGE])
async def test_other_constructors_refuse_durations_nan_infinite_or_beyond_their_setting(
        dsn: str, pool: asyncpg.Pool, bad: float) -> None:
    import pgcoord

    # Before: Lease(ttl=1e300) leaked a DataError at acquire(), Member(ttl=1e300) and
    # LockHolder(keepalive=1e300) an InvalidParameterValueError (tcp_keepalives_idle),
    # LockHolder(keepalive=inf) an OverflowError, exclusive(timeout=1e300) one for
    # lock_timeout. Now each is refused where it is given.
    await refused(lambda: pgcoord.Lease(pool, unique("l"), ttl=bad))
    await refused(lambda: pgcoord.Elector(dsn, unique("e"), ttl=bad))
    await refused(lambda: pgcoord.Member(dsn, ttl=bad))
    await refused(lambda: pgcoord.LockHolder(dsn, keepalive=bad))
    lease = pgcoord.Lease(pool, unique("l"), ttl=5)
    await refused(lease.acquire(timeout=bad))
    async with pool.acquire() as conn, conn.transaction():
        await refused(lambda: pgcoord.exclusive(conn, "k", timeout=bad))
        await refused(lambda: pgcoord.semaphore(conn, "s", limit=2, timeout=bad))
    async with pgcoord.LockHolder(dsn) as holder:
        await refused(lambda: holder.lock("k", timeout=bad))
    assert sql(dsn, "select count(*) from pgcoord.leases where holder is not null"
                    " and name like 'l:%%'") in ([(0,)], [])


@pytest.mark.parametrize("bad", ["a\x00b", "x" * 3000])
async def test_other_constructors_refuse_names_the_database_cannot_store(
        dsn: str, pool: asyncpg.Pool, bad: str) -> None:
    import pgcoord

    # Before: a NUL in a lease name or holder, a member's group, name or meta leaked
    # CharacterNotInRepertoireError (or was accepted, for an Elector, to fail in its
    # campaign); NaN in a member's meta leaked an invalid-json error.
    await refused(lambda: pgcoord.Lease(pool, bad, ttl=5))
    await refused(lambda: pgcoord.Lease(pool, "l", ttl=5, holder=bad))
    await refused(lambda: pgcoord.Elector(dsn, bad))
    await refused(lambda: pgcoord.Elector(dsn, "e", holder=bad))
    await refused(lambda: pgcoord.Member(dsn, group=bad))
    await refused(lambda: pgcoord.Member(dsn, name=bad))
    async with pgcoord.Member(dsn) as member:
        await refused(lambda: pgcoord.Partitions(member, bad, count=2))


async def test_member_meta_jsonb_cannot_store_is_refused(dsn: str) -> None:
    import pgcoord

    await refused(lambda: pgcoord.Member(dsn, meta={"k": "a\x00b"}))
    await refused(lambda: pgcoord.Member(dsn, meta={"k": NAN}), TypeError)


# -- the CLI: every operator mistake exits 2 in one line -------------------------------------

def _with_query(dsn: str, query: str) -> str:
    return f"{dsn}{'&' if '?' in dsn else '?'}{query}"


@pytest.mark.parametrize("argv", [
    # Before: exit 1, "NumericValueOutOfRange: bigint out of range".
    ["jobs", "history", "x", "--limit", "99999999999999999999"],
    ["jobs", "history", "x", "--limit", "3000000000"],
    ["doctor", "--locks", "99999999999999999999"],
    ["doctor", "--connections", "99999999999999999999"],
    # Before: exit 1, "ValueError: Invalid value NaN" / "OverflowError: timestamp out of range".
    ["status", "--watch", "nan"], ["status", "--watch", "inf"], ["status", "--watch", "1e300"],
    # Before: a usage block of several lines.
    ["jobs", "resume", "x", "--catch-up", "all"], ["status", "--no-such-option"], [],
])
def test_cli_options_out_of_range_exit_2_in_one_line(dsn: str, argv: list[str]) -> None:
    result = cli(*argv, *(["--dsn", dsn] if argv else []))
    line = one_line(result, 2)
    assert "Traceback" not in line


@pytest.mark.parametrize("command", ["status", "jobs", "doctor", "migrate"])
@pytest.mark.parametrize("option", [
    "connect_timeout=abc",  # before: exit 1, "ProgrammingError: bad value for connect_timeout"
    "keepalives=abc",       # before: exit 3, "cannot connect"
    "sslmode=bogus",
    "target_session_attrs=bogus",
    "port=99999",           # before: exit 3, "cannot connect ... invalid port number"
    "port=0",
])
def test_a_bad_connection_option_exits_2_in_one_line(dsn: str, command: str, option: str) -> None:
    key = option.split("=")[0]
    params = " ".join(f"{k}={v}" for k, v in conninfo_to_dict(dsn).items())
    # key=value DSNs too, but migrate takes URLs only (and says so, with 2).
    for given in [_with_query(dsn, option)] + ([] if command == "migrate" else [f"{params} {option}"]):
        result = cli(command, "--dsn", given)
        if command == "doctor" and "=bogus" in option:
            # libpq refuses it on connecting: doctor's report says so (its connect check
            # fails), and a failed check exits 2.
            assert result.returncode == 2 and key in result.stdout, (result.stdout, result.stderr)
            assert "Traceback" not in result.stderr
        else:
            assert key in one_line(result, 2)


def test_a_bad_pgconnect_timeout_exits_2_in_one_line(dsn: str) -> None:
    env = {"PGCONNECT_TIMEOUT": "abc"}
    assert "PGCONNECT_TIMEOUT" in one_line(cli("status", "--dsn", dsn, env=env), 2)


def one_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pgcoord: "), result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    return lines[0]


async def test_text_jsonb_cannot_hold_and_nesting_beyond_the_bound_are_refused_at_the_call(
        dsn: str, pool: asyncpg.Pool) -> None:
    import pgcoord

    # Before: a lone surrogate leaked asyncpg's InvalidTextRepresentationError at add(),
    # update() and Member.open(); args nested 20,000 deep a StatementTooComplexError.
    s = Scheduler(pool)
    deep: object = 1
    for _ in range(20_000):
        deep = [deep]
    name = unique("surrogate")
    for args in ({"a": "\ud800"}, {"\udc80": 1}, {"deep": deep}):
        with pytest.raises(ValueError):
            await s.add(name, "0 9 * * *", handler="h", args=args)
    await s.add(name, "0 9 * * *", handler="h")
    with pytest.raises(ValueError):
        await s.update(name, args={"k": "\udc80"})
    with pytest.raises(ValueError):
        pgcoord.Member(dsn, meta={"a": "\ud800"})


@pytest.mark.parametrize("bad", ["k\x00x", "\ud800"])
async def test_lock_names_text_cannot_hold_are_refused_at_the_call(
        dsn: str, pool: asyncpg.Pool, bad: str) -> None:
    import pgcoord

    # Before: a NUL was held under a name never recorded (pgcoord.lock_key() in SQL
    # cannot compute it); a lone surrogate raised a bare UnicodeEncodeError.
    with pytest.raises(ValueError, match="lock name"):
        async with pgcoord.exclusive(pool, bad):
            pass
    with pytest.raises(ValueError, match="lock name"):
        async with pgcoord.semaphore(pool, bad, limit=2):
            pass
    async with pgcoord.LockHolder(dsn) as holder:
        with pytest.raises(ValueError, match="lock name"):
            async with holder.lock(bad):
                pass
