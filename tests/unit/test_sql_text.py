"""The named-query parser and the migration statement splitter."""

from __future__ import annotations

import pytest

from pgcoord._core import queries as _queries
from pgcoord._core.resources import read_sql
from pgcoord.migrations import split_statements


def test_parser_splits_named_blocks_and_drops_their_doc_comments() -> None:
    text = "-- name: one\n-- what it does\nSELECT 1\n\n-- name: two\nSELECT $1, $2\n"
    assert _queries.parse(text) == {"one": "SELECT 1", "two": "SELECT $1, $2"}


def test_parser_refuses_duplicate_and_empty_blocks() -> None:
    with pytest.raises(ValueError, match="twice"):
        _queries.parse("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")
    with pytest.raises(ValueError, match="empty"):
        _queries.parse("-- name: a\n-- only a comment\n")


def test_every_packaged_query_parses() -> None:
    queries = _queries.parse(read_sql("queries.sql"))
    assert {"advisory_wait", "advisory_try", "advisory_timeout", "lock_names_record"} <= set(queries)


def test_placeholders_are_rewritten_per_driver() -> None:
    sql = "INSERT INTO t (a, b) VALUES ($1, $2)"
    assert _queries.to_pyformat(sql) == "INSERT INTO t (a, b) VALUES (%s, %s)"
    assert _queries.to_named(sql) == "INSERT INTO t (a, b) VALUES (:p1, :p2)"
    with pytest.raises(ValueError):
        _queries.to_pyformat("SELECT $2, $1")


def test_splitter_keeps_dollar_quoted_bodies_strings_and_comments_intact() -> None:
    script = """
    -- a comment; with a semicolon
    CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $body$ BEGIN RETURN 1; END $body$;
    SELECT 'it''s; fine', "odd;name" FROM t;
    DO $$ BEGIN PERFORM 1; END $$
    """
    statements = split_statements(script)
    assert len(statements) == 3
    assert statements[0].endswith("$body$ BEGIN RETURN 1; END $body$")
    assert statements[1] == "SELECT 'it''s; fine', \"odd;name\" FROM t"
    assert statements[2] == "DO $$ BEGIN PERFORM 1; END $$"


def test_migration_sql_avoids_characters_drivers_treat_as_placeholders() -> None:
    from pgcoord._core.resources import sql_dir

    for path in sql_dir().glob("*.sql"):
        if path.name == "queries.sql":
            continue
        text = path.read_text()
        assert "%" not in text, path.name


def test_begin_and_lock_carries_the_transaction_mode_and_refuses_unknown_levels() -> None:
    from pgcoord._drivers.base import LockStatement, begin_and_lock

    lock = LockStatement("SELECT pg_catalog.pg_advisory_xact_lock(7)", "", ())
    assert begin_and_lock(lock) == "BEGIN; SELECT pg_catalog.pg_advisory_xact_lock(7)"
    assert begin_and_lock(lock, "REPEATABLE READ", True, False) == (
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY NOT DEFERRABLE; "
        "SELECT pg_catalog.pg_advisory_xact_lock(7)"
    )
    with pytest.raises(ValueError, match="isolation"):
        begin_and_lock(lock, "SERIALIZABLE; DROP TABLE x")


def test_every_packaged_query_can_be_sent_by_every_driver() -> None:
    # psycopg's %s placeholders are positional: a query that names $1 twice
    # would work on asyncpg and fail on psycopg.
    for name, text in _queries._all().items():
        if "$" in text and "{" not in text:
            _queries.to_pyformat(text)
        assert name in _queries._all()
    assert "member_state" in _queries._all()
