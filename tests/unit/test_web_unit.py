"""pgcoord.web's pure parts: credentials, access, CSRF tokens, formatting; and that the
base install does not need the web extra."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest

from pgcoord.web import security, views


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_import_pgcoord_does_not_import_the_web_extra() -> None:
    code = "import sys, pgcoord, pgcoord.sync; print(sorted(m for m in ('starlette', 'jinja2', 'uvicorn') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_basic_credentials_are_checked_whole() -> None:
    expected = ("ops", "pa:ss ü")
    assert security.check_basic(_basic("ops", "pa:ss ü"), expected) == "ops"
    for header in (None, "", "Bearer x", _basic("ops", "pa:ss"), _basic("op", "pa:ss ü"),
                   "Basic !!!not-base64", "Basic " + base64.b64encode(b"no-colon").decode()):
        assert security.check_basic(header, expected) is None, header


async def test_access_answers_are_checked() -> None:
    assert await security.allowed_actions(None, object()) == frozenset()
    assert await security.allowed_actions(lambda r: "all", object()) == frozenset(security.ACTIONS)
    assert await security.allowed_actions(lambda r: "read_only", object()) == frozenset()
    assert await security.allowed_actions(lambda r: {"pause"}, object()) == {"pause"}

    async def deferred(request: object) -> str:
        return "all"

    assert await security.allowed_actions(deferred, object()) == frozenset(security.ACTIONS)
    with pytest.raises(TypeError, match="unknown action"):
        await security.allowed_actions(lambda r: {"drop"}, object())
    with pytest.raises(TypeError, match="'all', 'read_only'"):
        await security.allowed_actions(lambda r: "everything", object())


def test_a_csrf_token_belongs_to_its_nonce_and_its_process() -> None:
    csrf, other = security.Csrf(), security.Csrf()
    nonce = csrf.new_nonce()
    assert csrf.valid(nonce, csrf.token(nonce))
    assert not csrf.valid(nonce, other.token(nonce))
    assert not csrf.valid(csrf.new_nonce(), csrf.token(nonce))
    assert not csrf.valid(None, csrf.token(nonce)) and not csrf.valid(nonce, None)


def test_names_become_one_path_segment_and_ages_read_short() -> None:
    assert views.segment("a/b %'\"ü") == "a%2Fb%20%25%27%22%C3%BC"
    assert [views.age(s) for s in (None, -1, 3.24, 125, 7200, 200000)] == \
        ["-", "0.0s", "3.2s", "2m 05s", "2.0h", "2.3d"]
