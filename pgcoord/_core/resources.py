"""Where the packaged SQL and Alembic environment live.

A wheel carries ``sql/`` and ``migrations/`` inside the package as ``_sql`` and
``_migrations``; a source checkout (editable install, tests) has them beside the
package. Both layouts resolve to the same files.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pgcoord/


def _locate(packaged: str, in_checkout: str) -> Path:
    for candidate in (_PACKAGE_DIR / packaged, _PACKAGE_DIR.parent / in_checkout):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"pgcoord is installed without its {in_checkout}/ directory; reinstall the package"
    )


@cache
def sql_dir() -> Path:
    return _locate("_sql", "sql")


@cache
def migrations_dir() -> Path:
    return _locate("_migrations", "migrations")


def read_sql(filename: str) -> str:
    return (sql_dir() / filename).read_text(encoding="utf-8")
