"""CI's bookkeeping for the dependency matrix.

``python .ci/versions.py check``: every range that pyproject.toml declares for a
tracked package has a lower bound, and .ci/oldest-constraints.txt pins exactly
that bound, so the oldest venv really tests the bottom of each range.

``python .ci/versions.py show``: the versions installed in the running venv, and
the PostgreSQL server the tests will start (one line each, for the CI log and the
table "Supported versions" in CONTRIBUTING.md).
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACKED = ("sqlalchemy", "asyncpg", "psycopg", "psycopg-binary", "psycopg-pool", "alembic",
           "cronsim", "prometheus-client", "opentelemetry-api", "opentelemetry-sdk",
           "starlette", "jinja2", "uvicorn", "selenium")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_lower_bounds() -> dict[str, set[str]]:
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    bounds: dict[str, set[str]] = {}
    for spec in specs:
        req = Requirement(spec)
        name = _norm(req.name)
        if name == "pgcoord":
            continue
        names = [name] + (["psycopg-binary"] if name == "psycopg" and "binary" in req.extras else [])
        lower = {s.version for s in req.specifier if s.operator in (">=", "==", "~=")}
        for n in names:
            bounds.setdefault(n, set()).update(lower or {"<none>"})
    return bounds


def pinned() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / ".ci" / "oldest-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version.strip()
    return pins


def check() -> int:
    from packaging.version import Version

    bounds, pins, problems = declared_lower_bounds(), pinned(), []
    for name in TRACKED:
        lows = bounds.get(name)
        if not lows:
            problems.append(f"{name}: not declared in pyproject.toml")
        elif len(lows) != 1 or "<none>" in lows:
            problems.append(f"{name}: pyproject.toml declares lower bounds {sorted(lows)}; use one")
        elif name not in pins or Version(pins[name]) != Version(next(iter(lows))):
            problems.append(f"{name}: pyproject.toml says >={next(iter(lows))}, "
                            f".ci/oldest-constraints.txt pins {pins.get(name)}")
    for problem in problems:
        print(f"versions: {problem}", file=sys.stderr)
    if not problems:
        print("versions: .ci/oldest-constraints.txt pins the lower bound of every tracked range")
    return 1 if problems else 0


def show() -> int:
    sys.path.insert(0, str(ROOT))
    from pgcoord._core.embedded import find_bindir

    parts = [f"python {sys.version.split()[0]}"]
    for name in TRACKED:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} -")
    bindir = find_bindir()
    banner = os.popen(f"'{bindir / 'postgres'}' --version").read()
    server = m.group(1) if (m := re.search(r"\(PostgreSQL\) (\S+)", banner)) else banner.strip()
    parts.append(f"postgresql {server} ({bindir})")
    print("versions: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit({"check": check, "show": show}[sys.argv[1]]())
