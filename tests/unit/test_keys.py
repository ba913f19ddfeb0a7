"""lock_key(): golden vectors from shared/key-vectors.json, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pgcoord

VECTORS = json.loads((Path(__file__).parent.parent / "key-vectors.json").read_text())["vectors"]


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: v["name"][:20] or "empty")
def test_string_keys_match_the_published_vectors(vector: dict[str, object]) -> None:
    assert pgcoord.lock_key(vector["name"]) == vector["key"]  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [0, 1, -1, 2**63 - 1, -(2**63)])
def test_int_keys_are_returned_unchanged(key: int) -> None:
    assert pgcoord.lock_key(key) == key


@pytest.mark.parametrize("key", [2**63, -(2**63) - 1, 10**30])
def test_int_keys_out_of_range_raise_value_error(key: int) -> None:
    with pytest.raises(ValueError, match="64-bit"):
        pgcoord.lock_key(key)


@pytest.mark.parametrize("key", [True, False, 1.0, None, b"bytes", ("a",), 3j])
def test_other_types_raise_type_error(key: object) -> None:
    with pytest.raises(TypeError, match="int or a str"):
        pgcoord.lock_key(key)  # type: ignore[arg-type]


def test_importing_pgcoord_imports_no_driver() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pgcoord; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('asyncpg', 'psycopg', 'psycopg_pool', 'sqlalchemy', 'alembic')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
