"""The sync halves (``pgcoord/**/_sync/``) are generated from their async source by
tools/generate_sync.py. A failure here means one was edited by hand or its source
changed since: run ``python tools/generate_sync.py`` and commit what it writes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "generate_sync.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_sync_module_is_current() -> None:
    result = subprocess.run([sys.executable, str(TOOL), "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        "generated sync code is stale; run `python tools/generate_sync.py`\n"
        + result.stdout + result.stderr)


def test_the_transaction_scope_sync_code_is_generated() -> None:
    tool = _tool()
    generated = {tool.target(p).relative_to(ROOT).as_posix() for p in tool.sources()}
    assert {
        "pgcoord/_drivers/_sync/session.py",
        "pgcoord/locks/txscope/_sync/scoped.py",
        "pgcoord/locks/txscope/_sync/exclusive.py",
        "pgcoord/locks/txscope/_sync/semaphore.py",
        "pgcoord/locks/txscope/_sync/fence.py",
    } <= generated


def test_the_check_finds_a_hand_edit_and_an_orphan(tmp_path: Path) -> None:
    tool = _tool()
    package = tmp_path / "pgcoord"
    shutil.copytree(ROOT / "pgcoord" / "locks" / "txscope", package / "locks" / "txscope")
    assert tool.stale(package, tmp_path) == []

    edited = package / "locks" / "txscope" / "_sync" / "exclusive.py"
    edited.write_text(edited.read_text(encoding="utf-8") + "# a hand edit\n", encoding="utf-8")
    (found, diff), = tool.stale(package, tmp_path)
    assert found == edited and "-# a hand edit" in diff

    (package / "locks" / "txscope" / "_async" / "fence.py").unlink()
    assert {p.name for p, _ in tool.stale(package, tmp_path)} == {"exclusive.py", "fence.py"}
    assert {p.name for p in tool.write(package, tmp_path)} == {"exclusive.py", "fence.py"}
    assert tool.stale(package, tmp_path) == []
    assert not (package / "locks" / "txscope" / "_sync" / "fence.py").exists()
