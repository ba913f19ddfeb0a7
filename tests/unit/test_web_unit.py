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
                   "Basic !!!not-base64", "Basic " + base64.b64encode(b"no-colon").decode(),
                   # non-ASCII in the header itself (a server hands it over as latin-1)
                   "Basic é", "Basic \xff\xfe", "Basic " + base64.b64encode(b"\xff:\xfe").decode()):
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
    assert await security.allowed_actions(lambda r: ["pause", "pause"], object()) == {"pause"}
    # A mapping looks like {action: allowed?}; its keys alone would grant what it denies.
    for answer in ({"pause": False}, {"pause": True}, True, 1):
        with pytest.raises(TypeError, match="'all', 'read_only'"):
            await security.allowed_actions(lambda r, a=answer: a, object())


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


async def test_the_sampler_reads_at_most_once_an_interval_however_many_ask() -> None:
    import asyncio
    import datetime as dt

    from pgcoord.web.sample import Sample
    from pgcoord.web.sampler import Sampler

    reads = 0

    async def read() -> Sample:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.05)
        return Sample(now=dt.datetime.now(dt.UTC), version=str(reads // 3))

    sampler = Sampler(read, interval=0.2)
    first = await asyncio.gather(*(sampler.current() for _ in range(50)))
    assert reads == 1 and len({id(s) for s in first}) == 1  # one reading, shared
    # A page that goes away mid-reading cancels nobody else's.
    await asyncio.sleep(0.25)
    leaving = asyncio.create_task(sampler.current())
    staying = asyncio.create_task(sampler.current())
    await asyncio.sleep(0.01)
    leaving.cancel()
    assert (await staying) is not None and reads == 2
    # Open pages: one loop, about one reading an interval, ended after the last.
    started = asyncio.get_running_loop().time()
    async with sampler.listening() as next_change, sampler.listening():
        assert sampler.loops_started == 1 and sampler.listeners == 2
        await next_change("no such version", 1.0)
        await asyncio.sleep(1.0)
    elapsed = asyncio.get_running_loop().time() - started
    assert reads - 2 <= elapsed / 0.2 + 1
    await asyncio.sleep(0.3)
    assert not sampler.running
    await sampler.stop()
