"""The driver seam without a database: the one DSN rule, adapt() on what no driver
made, and that nothing outside pgcoord/_drivers asks which driver an object is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pgcoord
from pgcoord._drivers import adapt, driver_of, find_adapter
from pgcoord._drivers import dsn as dsn_rule
from pgcoord._drivers.adapt import is_pool_timeout

URL = "postgresql://u@h:5432/db"
KEY_VALUE = "host=a,b port=5432,5432 dbname=db target_session_attrs=read-write"


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The drivers the rule may find installed: edit the set in the test."""
    found = {"asyncpg", "psycopg"}
    monkeypatch.setattr(dsn_rule, "_installed", lambda name: name in found)
    return found


def test_an_explicit_driver_wins(installed: set[str]) -> None:
    assert dsn_rule.choose_driver(URL, "psycopg") == "psycopg"
    assert dsn_rule.choose_driver(URL, "asyncpg", prefer=dsn_rule.OPERATOR) == "asyncpg"
    with pytest.raises(ValueError, match="driver must be"):
        dsn_rule.choose_driver(URL, "pg8000")
    with pytest.raises(ValueError, match="asyncpg reads only postgresql:// URLs"):
        dsn_rule.choose_driver(KEY_VALUE, "asyncpg")


def test_otherwise_the_first_installed_driver_of_the_callers_order_that_reads_the_dsn(
    installed: set[str],
) -> None:
    assert dsn_rule.choose_driver(URL) == "asyncpg"  # the library's order
    assert dsn_rule.choose_driver(URL, prefer=dsn_rule.OPERATOR) == "psycopg"  # the commands'
    assert dsn_rule.choose_driver(KEY_VALUE) == "psycopg"  # only libpq reads key=value
    installed.discard("asyncpg")
    assert dsn_rule.choose_driver(URL) == "psycopg"
    installed.discard("psycopg")
    installed.add("asyncpg")
    assert dsn_rule.choose_driver(URL, prefer=dsn_rule.OPERATOR) == "asyncpg"
    with pytest.raises(pgcoord.UnsupportedConnection, match="key=value DSN needs psycopg"):
        dsn_rule.choose_driver(KEY_VALUE)
    installed.clear()
    with pytest.raises(pgcoord.UnsupportedConnection, match="needs asyncpg or psycopg"):
        dsn_rule.choose_driver(URL)


def test_every_host_of_a_url_is_listed_in_order() -> None:
    assert dsn_rule.url_hosts("postgresql://u@a:1,[::1]:2,b/db") == [("a", 1), ("::1", 2), ("b", None)]
    assert dsn_rule.url_hosts("postgresql:///db?host=a,b&port=5,6") == [("a", 5), ("b", 6)]


def test_adapt_refuses_what_no_driver_made() -> None:
    for thing in (object(), "postgresql://x/y", 3, ValueError()):
        assert find_adapter(thing) is None
        assert driver_of(thing) is None
        with pytest.raises(pgcoord.UnsupportedConnection, match="pgcoord cannot use"):
            adapt(thing)
    assert is_pool_timeout(TimeoutError()) and not is_pool_timeout(ValueError())


# The ways pgcoord used to tell drivers apart, before adapt() was the one place to ask.
_DRIVER_CHECKS = re.compile(
    r"__module__|\.__mro__|startswith\(\"(psycopg|asyncpg|sqlalchemy)|isinstance\([^)]*\b(asyncpg|psycopg|psycopg_pool)\."
)


def test_only_the_driver_seam_asks_which_driver_an_object_is() -> None:
    package = Path(pgcoord.__file__).parent
    offenders = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in sorted(package.rglob("*.py")) if "_drivers" not in path.parts
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _DRIVER_CHECKS.search(line)
    ]
    assert offenders == [], "ask pgcoord._drivers.adapt() instead:\n" + "\n".join(offenders)
