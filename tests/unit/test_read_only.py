"""A database that takes no writes, as each driver tells it, and the notice said once
per process (pgcoord/_core/readonly.py). Across a real Patroni demotion:
tests/ha_patroni/test_patroni_events.py."""

from __future__ import annotations

import logging

import asyncpg
import psycopg
import pytest

from pgcoord._core import errmap, readonly
from pgcoord.errors import PgcoordError


@pytest.fixture(autouse=True)
def writable_at_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The notice is per process: an earlier test may have left it said."""
    monkeypatch.setattr(readonly, "_since", None)
    monkeypatch.setattr(readonly, "_failing", {})
    monkeypatch.setattr(readonly, "_once_at", -1e9)


def test_every_form_of_no_writes_is_told_and_nothing_else() -> None:
    assert errmap.read_only(psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT"))
    assert errmap.read_only(PgcoordError(errmap.READ_ONLY_MESSAGE))
    assert errmap.read_only(asyncpg.exceptions.TargetServerAttributeNotMatched("none match"))
    # libpq's words for target_session_attrs=read-write finding no such host: no SQLSTATE.
    assert errmap.read_only(psycopg.OperationalError(
        'connection failed: connection to server at "127.0.0.1", port 5 failed: session is read-only'))
    assert errmap.read_only(psycopg.OperationalError("... failed: server is in hot standby mode"))
    assert not errmap.read_only(psycopg.OperationalError("connection refused"))
    assert not errmap.read_only(psycopg.errors.AdminShutdown("terminating connection"))
    assert not errmap.read_only(PgcoordError("something else"))


def test_25006_maps_to_an_error_naming_the_cause_and_the_ha_demotion() -> None:
    mapped = errmap.as_schema_missing(psycopg.errors.ReadOnlySqlTransaction("read-only"))
    assert isinstance(mapped, PgcoordError)
    assert "25006" in str(mapped) and "Patroni" in str(mapped) and "standby" in str(mapped)


def test_the_notice_is_said_once_until_writes_are_accepted_again(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("pgcoord.test")
    no_host = asyncpg.exceptions.TargetServerAttributeNotMatched("none match")
    with caplog.at_level(logging.DEBUG, logger="pgcoord"):
        for _ in range(50):
            readonly.retrying(logger, no_host, "elector %r: %r; campaigning again", "e", no_host)
        readonly.retrying(logger, ConnectionRefusedError(111, "refused"), "tick failed: %r", "x")
        readonly.writable()
        readonly.writable()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m[:31] for m in warnings] == ["the database takes no writes no", "tick failed: 'x'",
                                          "the database takes writes again"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 50


def test_one_loop_writing_does_not_end_the_notice_while_another_still_meets_it(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An elector on its own session (which sets the default off for itself) keeps
    writing while a scheduler on the pool's read-only connections keeps failing: one
    notice for the spell, not a pair of warnings each time the elector renews."""
    logger = logging.getLogger("pgcoord.test")
    refused = psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT")
    with caplog.at_level(logging.DEBUG, logger="pgcoord"):
        for _ in range(20):
            readonly.retrying(logger, refused, "tick failed", key="scheduler")
            readonly.writable("elector")
        readonly.writable("scheduler")
        # A one-shot (a release given up) starts the notice; another loop's success
        # right after it proves nothing, the failed loop's own does.
        readonly.retrying(logger, refused, "release given up")
        readonly.writable("elector")
        readonly.retrying(logger, refused, "tick failed", key="scheduler")
        readonly.writable("scheduler")
        # A loop that met the state and stopped (a holding lost) is not waited for
        # (once the one-shot's grace is over).
        monkeypatch.setattr(readonly, "ONCE_GRACE", 0.0)
        readonly.retrying(logger, refused, "renewal failed", key="tenure")
        readonly.forget("tenure")
        readonly.writable("elector")
        # Nor one that has not retried for a long while (it ended without saying).
        readonly.retrying(logger, refused, "renewal failed", key="gone")
        monkeypatch.setattr(readonly, "FORGET", 0.0)
        readonly.writable("elector")
    warnings = [r.getMessage()[:31] for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the database takes no writes no", "the database takes writes again"] * 4, warnings
