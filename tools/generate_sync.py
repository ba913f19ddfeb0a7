"""Generate pgcoord's sync halves from their async source, with unasync.

Each ``pgcoord/**/_async/*.py`` is the one hand-written source of the module of the
same name in the sibling ``_sync/`` package. unasync rewrites tokens: ``async`` and
``await`` go, ``async with`` becomes ``with``, ``__aenter__`` ``__enter__``, a name
``AsyncX`` becomes ``SyncX``. On top of that, here:

- a name that ends in ``_async`` ends in ``_sync`` (the ``_async`` packages themselves,
  ``release_async``, a method ``_take_async``), so what the two halves import from
  shared modules is named for its half;
- the few names in ``REPLACEMENTS``.

Docstrings and comments are copied as they are: the async source is written so that
they read right in both halves.

    python tools/generate_sync.py          # write every sync half
    python tools/generate_sync.py --check  # exit 1 if one differs from what this writes
"""

from __future__ import annotations

import argparse
import difflib
import io
import sys
import tempfile
import tokenize
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pgcoord"

SUFFIX_ASYNC, SUFFIX_SYNC = "_async", "_sync"

#: Names whose sync form the rules above do not give.
REPLACEMENTS = {
    "asyncio": "time",  # `from asyncio import sleep`
    "fetchval_on": "fetchval_on_sync",
}

HEADER = "# Generated from {source} by tools/generate_sync.py: do not edit.\n"


def sources(package: Path = PACKAGE) -> list[Path]:
    """Every async source module under ``package``."""
    return sorted(package.glob(f"**/{SUFFIX_ASYNC}/*.py"))


def target(source: Path) -> Path:
    """The sync module generated from ``source``."""
    return source.parent.with_name(SUFFIX_SYNC) / source.name


def _suffixed_names(text: str) -> dict[str, str]:
    names = {
        tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.NAME and tok.string.endswith(SUFFIX_ASYNC)
    }
    return {name: name[: -len(SUFFIX_ASYNC)] + SUFFIX_SYNC for name in names}


def render(source: Path, root: Path = ROOT) -> str:
    """The sync module that ``source`` generates, header included."""
    text = source.read_text(encoding="utf-8")
    rule = unasync.Rule(f"/{SUFFIX_ASYNC}/", f"/{SUFFIX_SYNC}/",
                        additional_replacements={**_suffixed_names(text), **REPLACEMENTS})
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / SUFFIX_ASYNC / source.name
        copy.parent.mkdir()
        copy.write_text(text, encoding="utf-8")
        unasync.unasync_files([str(copy)], [rule])
        body = (Path(tmp) / SUFFIX_SYNC / source.name).read_text(encoding="utf-8")
    return HEADER.format(source=source.relative_to(root).as_posix()) + body


def stale(package: Path = PACKAGE, root: Path = ROOT) -> list[tuple[Path, str]]:
    """Each generated module that differs from what its source generates (or is
    missing), with a diff; and each generated-looking module whose source is gone."""
    found: list[tuple[Path, str]] = []
    expected = set()
    for source in sources(package):
        out = target(source)
        expected.add(out)
        want = render(source, root)
        have = out.read_text(encoding="utf-8") if out.exists() else ""
        if have != want:
            diff = difflib.unified_diff(have.splitlines(keepends=True), want.splitlines(keepends=True),
                                        str(out.relative_to(root)), "generated")
            found.append((out, "".join(diff)))
    for out in sorted(package.glob(f"**/{SUFFIX_SYNC}/*.py")):
        if out not in expected and out.read_text(encoding="utf-8").startswith("# Generated from "):
            found.append((out, f"{out.relative_to(root)}: generated, but its source is gone\n"))
    return found


def write(package: Path = PACKAGE, root: Path = ROOT) -> list[Path]:
    """Write every generated module that is not current; the ones written."""
    written = []
    for out, _ in stale(package, root):
        source = out.parent.with_name(SUFFIX_ASYNC) / out.name
        if not source.exists():
            out.unlink()
        else:
            out.parent.mkdir(exist_ok=True)
            out.write_text(render(source, root), encoding="utf-8")
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a generated module is not current")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for _, diff in found:
            sys.stdout.write(diff)
        if found:
            print(f"{len(found)} generated module(s) out of date: run python tools/generate_sync.py",
                  file=sys.stderr)
            return 1
        return 0
    for out in write():
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
