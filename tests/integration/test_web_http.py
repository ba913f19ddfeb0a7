"""pgcoord.web over HTTP: a real uvicorn server, a real database, httpx as the client.

Every page and its JSON twin show the state the test made; actions need access and a
CSRF token; basic auth; bad input gets a 4xx with a clear message; the dashboard
mounts in FastAPI and in Django's ASGI app; one sampler serves every open page.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import asyncpg
import httpx
import pytest

import pgcoord
import pgcoord.web

from .conftest import sql, unique
from .web_server import serve, serve_here


@contextlib.asynccontextmanager
async def leading(dsn: str, name: str, holder: str) -> AsyncIterator[pgcoord.Elector]:
    elector = pgcoord.Elector(dsn, name, ttl=5.0, holder=holder)
    task = asyncio.create_task(elector.run(lambda fence: asyncio.Event().wait()))
    try:
        async with asyncio.timeout(10):
            while not elector.is_leader:
                await asyncio.sleep(0.02)
        yield elector
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    yield p
    await p.close()


def add_slots(dsn: str, job: str, n: int) -> None:
    sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner, started_at,"
             " finished_at, error)"
             " select %s, now() - make_interval(mins => g),"
             " case when g = 1 then 'failed' else 'succeeded' end, 1, 'runner-a',"
             " now() - make_interval(mins => g), now() - make_interval(mins => g) + interval '1s',"
             " case when g = 1 then 'boom: it broke' end"
             " from generate_series(1, %s) as g", job, n)


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found, "the page has no action form"
    return found.group(1)


async def test_every_page_and_its_json_twin_show_the_state_the_test_made(
        dsn: str, pool: asyncpg.Pool) -> None:
    election, group, lock = unique("web-elect"), unique("web-group"), unique("web-lock")
    job = unique("web-job")
    sched = pgcoord.Scheduler(pool)
    await sched.add(job, "*/5 * * * *", handler="web-handler", tz="Europe/Berlin")
    add_slots(dsn, job, 3)

    async def wait_for_lock() -> None:
        async with pgcoord.exclusive(pool, lock):
            pass

    async with leading(dsn, election, "leader-a"), \
            pgcoord.Member(dsn, group=group, name="member-one", meta={"zone": "eu-1"}), \
            pgcoord.exclusive(pool, lock):
        waiter = asyncio.create_task(wait_for_lock())
        try:
            async with asyncio.timeout(5):
                while not sql(dsn, "select 1 from pgcoord.holders where name = %s and not granted", lock):
                    await asyncio.sleep(0.02)
            with serve(pgcoord.web.app(dsn)) as url:
                async with httpx.AsyncClient(base_url=url) as client:
                    await asyncio.sleep(1.05)  # a sample younger than the state
                    overview = await client.get("/")
                    assert overview.status_code == 200
                    assert "Overview" in overview.text and "waits for" in overview.text
                    api = (await client.get("/api/")).json()
                    assert api["health"]["ok"] and api["counts"]["waiting"] >= 1
                    assert api["counts"]["members"] >= 1 and api["counts"]["schedules"] >= 1
                    assert any(a["kind"] == "lock_wait" and a["name"] == lock for a in api["alerts"])
                    assert any(a["kind"] == "failing_schedule" and a["name"] == job for a in api["alerts"])

                    page = (await client.get("/elections")).text
                    assert election in page and "leader-a" in page and "Resign" in page
                    lease = next(e for e in (await client.get("/api/elections")).json()["elections"]
                                 if e["name"] == election)
                    assert lease["holder"] == "leader-a" and lease["held"] and lease["fence"] >= 1
                    assert lease["pid"] and lease["left_seconds"] > 0

                    page = (await client.get("/members")).text
                    assert group in page and "member-one" in page and "zone=eu-1" in page
                    groups = (await client.get("/api/members")).json()["groups"]
                    mine = next(g for g in groups if g["group"] == group)
                    assert [m["name"] for m in mine["members"]] == ["member-one"]
                    assert mine["members"][0]["meta"] == {"zone": "eu-1"}

                    page = (await client.get("/locks")).text
                    assert lock in page and "Who blocks whom" in page
                    data = (await client.get("/api/locks")).json()
                    rows = [r for r in data["locks"] if r["name"] == lock]
                    assert sorted(r["granted"] for r in rows) == [False, True]
                    held = next(r for r in rows if r["granted"])
                    edge = next(e for e in data["waits_for"] if e["lock"] == lock)
                    assert edge["blocker_pid"] == held["pid"]
                    # The same rows `pgcoord status --json` prints, with the same keys.
                    from pgcoord.cli.status import fetch_holders
                    assert set(fetch_holders(dsn)[0]) <= set(rows[0])

                    page = (await client.get("/schedules")).text
                    assert job in page and "web-handler" in page and "Europe/Berlin" in page
                    assert "Pause" in page and "Trigger" in page
                    found = next(s for s in (await client.get("/api/schedules")).json()["schedules"]
                                 if s["name"] == job)
                    assert found["expr"] == "*/5 * * * *" and found["failing"] and not found["paused"]
                    assert found["next_run_at"] and found["last_state"] == "failed"

                    page = await client.get(f"/schedules/{quote(job, safe='')}")
                    assert page.status_code == 200 and "boom: it broke" in page.text
                    detail = (await client.get(f"/api/schedules/{quote(job, safe='')}")).json()
                    assert detail["total"] == 3 and len(detail["slots"]) == 3
                    assert detail["schedule"]["handler"] == "web-handler"
        finally:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await waiter


async def test_slot_history_is_paged_and_bad_page_numbers_get_a_4xx(
        dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("web-paged")
    await pgcoord.Scheduler(pool).add(job, "* * * * *", handler="h")
    add_slots(dsn, job, 120)
    path = f"/schedules/{quote(job, safe='')}"
    with serve(pgcoord.web.app(dsn)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            first = (await client.get("/api" + path)).json()
            assert (first["page"], first["pages"], len(first["slots"])) == (1, 3, 50)
            last = (await client.get("/api" + path, params={"page": 3})).json()
            assert len(last["slots"]) == 20
            assert last["slots"][-1]["slot_at"] < first["slots"][0]["slot_at"]
            page2 = await client.get(path, params={"page": 2})
            assert page2.status_code == 200 and "page 2 of 3" in page2.text
            past = await client.get(path, params={"page": 4})
            assert past.status_code == 404 and "page 4 is past the end: there are 3 pages" in past.text
            assert "Traceback" not in past.text
            for bad in ("0", "-1", "abc", "1.5", "", "²"):
                r = await client.get(path, params={"page": bad})
                assert r.status_code == 400, bad
                assert "page must be a whole number" in r.text
            r = await client.get("/api/schedules", params={"page": "99999999999999999999999"})
            assert r.status_code == 404 and "past the end" in r.json()["error"]


@pytest.mark.parametrize("name", ["100% done", "it's \"quoted\"", "zürich ☃", "a/b/c", "<b>x</b>", "x/"])
async def test_names_with_odd_characters_have_their_page(
        dsn: str, pool: asyncpg.Pool, name: str) -> None:
    job = unique(name)
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    with serve(pgcoord.web.app(dsn)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            listing = (await client.get("/schedules")).text
            assert f'/schedules/{quote(job, safe="")}"' in listing  # linked with every byte escaped
            page = await client.get(f"/schedules/{quote(job, safe='')}")
            assert page.status_code == 200
            assert ">" + job.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") \
                .replace('"', "&#34;").replace("'", "&#39;") + "<" in page.text
            assert "<b>x</b>" not in page.text
            api = (await client.get(f"/api/schedules/{quote(job, safe='')}")).json()
            assert api["name"] == job and api["schedule"]["name"] == job


async def test_unknown_and_impossible_names_get_a_clear_4xx(dsn: str) -> None:
    with serve(pgcoord.web.app(dsn)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            r = await client.get("/schedules/" + quote("no such 'job' ü/x", safe=""))
            assert r.status_code == 404
            assert "no schedule named &#34;no such &#39;job&#39; ü/x&#34;" in r.text \
                or "no schedule named &#39;no such" in r.text or "no schedule named" in r.text
            assert "Traceback" not in r.text
            r = await client.get("/api/schedules/nope-" + unique("x"))
            assert r.status_code == 404 and r.json()["error"].startswith("no schedule named")
            r = await client.get("/schedules/a%00b")
            assert r.status_code == 400 and "NUL" in r.text
            r = await client.get("/no/such/page")
            assert r.status_code == 404 and "Traceback" not in r.text
            r = await client.get("/api/locks", params={"page": 999})
            assert r.status_code == 404 and "page 999 is past the end" in r.json()["error"]
            r = await client.get("/schedules/")
            assert r.status_code == 303 and r.headers["location"].endswith("/schedules")
            r = await client.post("/actions/delete-everything", data={"name": "x"})
            assert r.status_code == 404 and "the actions are pause, resume, trigger, resign" in r.text


async def _form(client: httpx.AsyncClient, path: str) -> str:
    page = await client.get(path)
    assert page.status_code == 200
    return csrf_of(page.text)


def paused(dsn: str, name: str) -> bool:
    return bool(sql(dsn, "select paused from pgcoord.schedules where name = %s", name)[0][0])


async def test_read_only_by_default_actions_get_403(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("web-ro")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    with serve(pgcoord.web.app(dsn)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            page = (await client.get("/schedules")).text
            assert 'disabled title="read-only: you may not pause here">Pause</button>' in page
            token = await _form(client, "/schedules")
            r = await client.post("/actions/pause", data={"name": job, "csrf": token})
            assert r.status_code == 403 and "read-only" in r.text
            assert not paused(dsn, job)


async def test_actions_need_a_csrf_token_and_are_logged_with_who_did_them(
        dsn: str, pool: asyncpg.Pool, caplog: pytest.LogCaptureFixture) -> None:
    job = unique("web-act")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    caplog.set_level(logging.INFO, logger="pgcoord.web")
    with serve(pgcoord.web.app(dsn, access=lambda request: "all")) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            token = await _form(client, "/schedules")
            # No token, a wrong one, and the right one without its cookie: refused.
            for data, cookies in (({"name": job}, None), ({"name": job, "csrf": "0" * 64}, None),
                                  ({"name": job, "csrf": token}, {"pgcoord_csrf": "another"})):
                if cookies:
                    client.cookies.clear()
                    client.cookies.update(cookies)
                r = await client.post("/actions/pause", data=data)
                assert r.status_code == 403 and "CSRF check failed" in r.text
                assert not paused(dsn, job)
            client.cookies.clear()
            token = await _form(client, "/schedules")
            r = await client.post("/actions/pause", data={"name": job, "csrf": token,
                                                          "next": "/schedules?page=1"})
            assert r.status_code == 303 and r.headers["location"] == "/schedules?page=1"
            assert paused(dsn, job)
            r = await client.post("/actions/resume", data={"name": job, "csrf": token,
                                                           "next": "https://evil.example/"})
            assert r.status_code == 303 and r.headers["location"] == "/"
            assert not paused(dsn, job)
            r = await client.post("/actions/trigger", data={"name": job, "csrf": token},
                                  headers={"accept": "application/json"})
            assert r.status_code == 200 and r.json()["done"]
            assert sql(dsn, "select count(*) from pgcoord.schedule_owed where name = %s", job)[0][0] == 1
            r = await client.post("/actions/pause", data={"name": "no-" + job, "csrf": token})
            assert r.status_code == 404 and "no schedule named" in r.text
    records = [r.pgcoord for r in caplog.records if getattr(r, "pgcoord", {}).get("event") == "web_action"]
    done = [(r["action"], r["outcome"]) for r in records if r["name"] == job]
    assert done[-3:] == [("pause", "done"), ("resume", "done"), ("trigger", "done")]
    assert all(r["by"].startswith("127.0.0.1:") for r in records)


async def test_access_may_grant_some_actions(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("web-some")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    with serve(pgcoord.web.app(dsn, access=lambda request: {"trigger"})) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            token = await _form(client, "/schedules")
            r = await client.post("/actions/pause", data={"name": job, "csrf": token})
            assert r.status_code == 403 and not paused(dsn, job)
            r = await client.post("/actions/trigger", data={"name": job, "csrf": token})
            assert r.status_code == 303


async def test_resign_asks_the_leader_to_step_down(dsn: str) -> None:
    election = unique("web-resign")
    async with leading(dsn, election, "leader-r") as elector:
        fence = elector.fence
        with serve(pgcoord.web.app(dsn, access=lambda request: "all")) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                token = await _form(client, "/elections")
                r = await client.post("/actions/resign", data={"name": election, "csrf": token})
                assert r.status_code == 303
                async with asyncio.timeout(5):
                    while sql(dsn, "select fence from pgcoord.leases where name = %s", election)[0][0] == fence:
                        await asyncio.sleep(0.02)
                r = await client.post("/actions/resign", data={"name": "none-" + election, "csrf": token})
                assert r.status_code == 404 and "no lease with a live holder" in r.text
                # The term that ended shows in the leadership history: released when asked.
                await asyncio.sleep(1.05)
                shown = next(e for e in (await client.get("/api/elections")).json()["elections"]
                             if e["name"] == election)
                assert shown["terms"][-1]["fence"] == fence
                assert shown["terms"][-1]["ended_how"] == "released"
                assert shown["terms"][-1]["resign_requested_at"] is not None
                page = (await client.get("/elections")).text
                assert "Leadership history" in page and ">released<" in page


async def test_basic_auth_turns_away_requests_without_the_credentials(
        dsn: str, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    job = unique("web-auth")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    monkeypatch.setenv("PGCOORD_WEB_USER", "ops")
    monkeypatch.setenv("PGCOORD_WEB_PASSWORD", "s3cret ü")
    caplog.set_level(logging.INFO, logger="pgcoord.web")
    with serve(pgcoord.web.app(dsn, access=lambda request: "all")) as url:
        async with httpx.AsyncClient(base_url=url) as anonymous:
            for path in ("/", "/api/locks", "/static/style.css", "/events"):
                r = await anonymous.get(path)
                assert r.status_code == 401, path
                assert r.headers["www-authenticate"].startswith('Basic realm="pgcoord"')
            r = await anonymous.get("/", auth=("ops", "wrong"))
            assert r.status_code == 401
        async with httpx.AsyncClient(base_url=url, auth=("ops", "s3cret ü")) as client:
            assert (await client.get("/")).status_code == 200
            token = await _form(client, "/schedules")
            r = await client.post("/actions/pause", data={"name": job, "csrf": token})
            assert r.status_code == 303 and paused(dsn, job)
    by = [r.pgcoord["by"] for r in caplog.records if getattr(r, "pgcoord", {}).get("name") == job]
    assert by == ["ops"]


def test_basic_auth_needs_both_settings(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCOORD_WEB_USER", "ops")
    monkeypatch.delenv("PGCOORD_WEB_PASSWORD", raising=False)
    with pytest.raises(ValueError, match="PGCOORD_WEB_PASSWORD"):
        pgcoord.web.app(dsn)


async def test_mounted_in_fastapi_the_links_carry_the_prefix(dsn: str, pool: asyncpg.Pool) -> None:
    from fastapi import FastAPI

    job = unique("web-fastapi")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    host = FastAPI()
    dashboard = pgcoord.web.app(pool, access=lambda request: "all")
    host.mount("/ops/pgcoord", dashboard)

    @host.get("/hello")
    def hello() -> dict[str, str]:
        return {"hello": "world"}

    async with serve_here(host) as url, httpx.AsyncClient(base_url=url) as client:
        if True:
            assert (await client.get("/hello")).json() == {"hello": "world"}
            page = await client.get("/ops/pgcoord/schedules")
            assert page.status_code == 200 and job in page.text
            assert 'href="/ops/pgcoord/elections"' in page.text
            assert 'href="/ops/pgcoord/static/style.css"' in page.text
            assert f'href="/ops/pgcoord/schedules/{quote(job, safe="")}"' in page.text
            assert (await client.get("/ops/pgcoord/static/app.js")).status_code == 200
            api = await client.get("/ops/pgcoord/api/schedules")
            assert any(s["name"] == job for s in api.json()["schedules"])
            token = csrf_of(page.text)
            r = await client.post("/ops/pgcoord/actions/pause",
                                  data={"name": job, "csrf": token, "next": "/ops/pgcoord/schedules"})
            assert r.status_code == 303 and r.headers["location"] == "/ops/pgcoord/schedules"
            assert paused(dsn, job)
    await pgcoord.web.aclose(dashboard)


def test_mounted_in_django_through_its_asgi_router(dsn: str) -> None:
    """The recipe's asgi.py, served by uvicorn in a process of its own (Django's
    settings are process-wide)."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    job = unique("web-django")
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PGCOORD_DSN": dsn, "PYTHONPATH": str(root)}
    env.pop("PGCOORD_WEB_USER", None)
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.recipes.django_asgi:app",
                             "--port", str(port), "--log-level", "warning"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                django = httpx.get(url + "/hello/", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the Django app did not start"
                time.sleep(0.1)
        assert django.status_code == 200 and django.text == "hello from django"
        page = httpx.get(url + "/pgcoord/schedules")
        assert page.status_code == 200 and job in page.text
        assert 'href="/pgcoord/locks"' in page.text and 'href="/pgcoord/static/style.css"' in page.text
        api = httpx.get(f"{url}/pgcoord/api/schedules/{quote(job, safe='')}")
        assert api.json()["schedule"]["name"] == job
        assert httpx.get(url + "/pgcoordx").status_code == 404  # Django's, not the dashboard's
    finally:
        proc.terminate()
        proc.wait(10)


async def _sse_versions(client: httpx.AsyncClient, versions: list[str], opened: asyncio.Event,
                        path: str = "/events") -> None:
    async with client.stream("GET", path) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        opened.set()
        async for line in stream.aiter_lines():
            if line.startswith("data: "):
                versions.append(line[6:])


def _shares_of(dsn: str) -> list[Any]:
    from pgcoord.web import shared
    return [e for e in shared.entries() if e.key[0] == ("dsn", dsn)]


async def test_one_sampler_serves_every_open_page_and_stops_after_the_last(dsn: str) -> None:
    dashboard = pgcoord.web.app(dsn)
    with serve(dashboard) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # DESIGN §12's figure: 50 open pages cost one sampler.
            opened = [asyncio.Event() for _ in range(50)]
            streams = [asyncio.create_task(_sse_versions(client, [], o)) for o in opened]
            try:
                async with asyncio.timeout(20):
                    for o in opened:
                        await o.wait()
                sampler = dashboard.state.pgcoord_dashboard.latest.sampler
                assert sampler.listeners == 50 and sampler.loops_started == 1
                before = sampler.readings
                await asyncio.sleep(3.0)
                # about one reading a second, whatever the number of open pages
                assert 2 <= sampler.readings - before <= 4
                for _ in range(20):  # pages rendered meanwhile use the same samples
                    assert (await client.get("/locks")).status_code == 200
                assert sampler.readings - before <= 5
            finally:
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
            async with asyncio.timeout(5):
                while sampler.listeners or sampler.running:
                    await asyncio.sleep(0.05)


async def test_two_apps_on_one_database_in_one_process_share_one_sampler(dsn: str) -> None:
    """DESIGN §12: at most one reading a second per process, whatever the number of
    apps: two dashboards mounted in one host over the same DSN read through one
    sampler (and one pool); it goes when the last app shuts down."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    first, second = pgcoord.web.app(dsn), pgcoord.web.app(dsn)
    host = Starlette(routes=[Mount("/a", first), Mount("/b", second)])
    with serve(host) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            opened = [asyncio.Event() for _ in range(10)]
            streams = [asyncio.create_task(_sse_versions(client, [], o, f"/{'ab'[i % 2]}/events"))
                       for i, o in enumerate(opened)]
            try:
                async with asyncio.timeout(10):
                    for o in opened:
                        await o.wait()
                shares = _shares_of(dsn)
                assert len(shares) == 1 and shares[0].users == {id(first.state.pgcoord_dashboard),
                                                                 id(second.state.pgcoord_dashboard)}
                sampler = shares[0].sampler
                assert sampler.listeners == 10 and sampler.loops_started == 1
                before = sampler.readings
                await asyncio.sleep(3.0)
                assert 2 <= sampler.readings - before <= 4
                assert (await client.get("/a/")).status_code == 200
                assert (await client.get("/b/")).status_code == 200
            finally:
                for s in streams:
                    s.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
            async with asyncio.timeout(5):
                while sampler.listeners or sampler.running:
                    await asyncio.sleep(0.05)
    # A mounted app's shutdown is its host's to call (the host's lifespan does not
    # run the dashboard's); here the server's loop is gone, so the share is dropped.
    await pgcoord.web.aclose(first)
    assert len(_shares_of(dsn)) == 1
    await pgcoord.web.aclose(second)
    assert _shares_of(dsn) == []


async def test_a_change_reaches_an_open_stream_within_two_seconds(dsn: str, pool: asyncpg.Pool) -> None:
    job = unique("web-live")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    with serve(pgcoord.web.app(dsn)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            versions: list[str] = []
            opened = asyncio.Event()
            stream = asyncio.create_task(_sse_versions(client, versions, opened))
            try:
                async with asyncio.timeout(5):
                    while not versions:
                        await asyncio.sleep(0.02)
                await asyncio.sleep(1.2)
                first = len(versions)
                await pgcoord.Scheduler(pool).pause(job)
                started = asyncio.get_running_loop().time()
                async with asyncio.timeout(2.0):
                    while len(versions) == first:
                        await asyncio.sleep(0.02)
                assert asyncio.get_running_loop().time() - started < 2.0
                # and the page fragment the script fetches shows it
                fragment = await client.get("/schedules", headers={"X-Pgcoord-Fragment": "1"})
                assert "<html" not in fragment.text
                assert fragment.headers["x-pgcoord-version"] == versions[-1]
                row = re.search(rf'data-name="{re.escape(job)}">.*?</tr>', fragment.text, re.S)
                assert row and "paused" in row.group(0)
            finally:
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)


def test_a_connection_is_refused_and_an_unknown_object_too(dsn: str) -> None:
    import psycopg

    with psycopg.connect(dsn) as conn, pytest.raises(TypeError, match="not one connection"):
        pgcoord.web.app(conn)
    with pytest.raises(pgcoord.UnsupportedConnection):
        pgcoord.web.app(object())
    with pytest.raises(TypeError, match="access must be a callable"):
        pgcoord.web.app(dsn, access="all")  # type: ignore[arg-type]


async def test_a_database_that_cannot_be_read_is_a_503_with_the_reason(pg_server: Any) -> None:
    missing = pg_server.dsn("no_such_database_" + unique("x").split(":")[1])
    with serve(pgcoord.web.app(missing)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            page = await client.get("/")
            assert page.status_code == 200 and "The database could not be read" in page.text
            api = await client.get("/api/locks")
            assert api.status_code == 503 and not api.json()["health"]["ok"]
            assert "no_such_database" in json.dumps(api.json())


async def test_the_read_only_dashboard_runs_under_the_operator_role(fresh_db: str) -> None:
    import uuid

    import psycopg

    import pgcoord.migrations
    from pgcoord._core.resources import read_sql

    pgcoord.migrations.upgrade(fresh_db)
    suffix = uuid.uuid4().hex[:6]
    service, operator = f"svc_{suffix}", f"ops_{suffix}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {service} login; create role {operator} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", service)
                      .replace("pgcoord_operator", operator))
    election, job = unique("web-ops"), unique("web-ops-job")
    try:
        async with leading(fresh_db, election, "leader-o"):
            pool = await asyncpg.create_pool(fresh_db, min_size=1, max_size=2)
            try:
                await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
            finally:
                await pool.close()
            with serve(pgcoord.web.app(fresh_db.replace("postgres@", f"{operator}@"))) as url:
                async with httpx.AsyncClient(base_url=url) as client:
                    for path in ("/", "/elections", "/members", "/locks", "/schedules",
                                 f"/schedules/{quote(job, safe='')}"):
                        page = await client.get(path)
                        assert page.status_code == 200, path
                        assert "could not be read" not in page.text, (path, page.text)
                        api = await client.get("/api" + path)
                        assert api.status_code == 200, path
                    shown = (await client.get("/api/elections")).json()
                    assert shown["history"] and any(e["name"] == election and e["holder"] == "leader-o"
                                                    for e in shown["elections"])
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename in ('{service}', '{operator}')")
            admin.execute(f"drop owned by {service}; drop owned by {operator};"
                          f" drop role {service}; drop role {operator}")


@pytest.mark.parametrize("kind", ["psycopg ConnectionPool", "SQLAlchemy Engine",
                                  "psycopg AsyncConnectionPool", "SQLAlchemy AsyncEngine"])
async def test_every_kind_of_pool_serves_the_pages(dsn: str, pool: asyncpg.Pool, kind: str) -> None:
    import psycopg_pool
    import sqlalchemy
    from sqlalchemy.ext.asyncio import create_async_engine

    job = unique("web-pool")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    url = dsn.replace("postgresql://", "postgresql+psycopg://")
    if kind == "psycopg ConnectionPool":
        source: Any = psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=2, open=True)
        close: Any = source.close
    elif kind == "SQLAlchemy Engine":
        source = sqlalchemy.create_engine(url)
        close = source.dispose
    elif kind == "psycopg AsyncConnectionPool":
        source = psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False)
        await source.open()
        close = source.close
    else:
        source = create_async_engine(url)
        close = source.dispose
    try:
        async with serve_here(pgcoord.web.app(source, access=lambda request: "all")) as base, \
                httpx.AsyncClient(base_url=base) as client:
            assert (await client.get("/api/locks")).status_code == 200
            shown = (await client.get(f"/api/schedules/{quote(job, safe='')}")).json()
            assert shown["schedule"]["name"] == job
            token = await _form(client, "/schedules")
            r = await client.post("/actions/pause", data={"name": job, "csrf": token})
            assert r.status_code == 303 and paused(dsn, job)
    finally:
        result = close()
        if asyncio.iscoroutine(result):
            await result


#: What docs/web.md says a dashboard's role needs for its actions, on top of the operator's.
ACTION_GRANTS = """
GRANT UPDATE ON pgcoord.schedules TO {role};
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.schedule_pauses TO {role};
GRANT SELECT, UPDATE ON pgcoord.schedule_epoch TO {role};
GRANT SELECT, INSERT ON pgcoord.schedule_owed TO {role};
GRANT UPDATE ON pgcoord.leases TO {role};
"""


async def test_the_action_grants_of_the_docs_are_enough(fresh_db: str) -> None:
    import uuid

    import psycopg

    import pgcoord.migrations
    from pgcoord._core.resources import read_sql

    pgcoord.migrations.upgrade(fresh_db)
    suffix = uuid.uuid4().hex[:6]
    service, operator = f"svc_{suffix}", f"ops_{suffix}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {service} login; create role {operator} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", service)
                      .replace("pgcoord_operator", operator))
        admin.execute(ACTION_GRANTS.format(role=operator))
    election, job = unique("web-grants"), unique("web-grants-job")
    sql(fresh_db, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    try:
        async with leading(fresh_db, election, "leader-g") as elector:
            fence = elector.fence
            with serve(pgcoord.web.app(fresh_db.replace("postgres@", f"{operator}@"),
                                       access=lambda request: "all")) as url:
                async with httpx.AsyncClient(base_url=url) as client:
                    token = await _form(client, "/schedules")
                    for verb in ("pause", "resume", "trigger"):
                        r = await client.post(f"/actions/{verb}", data={"name": job, "csrf": token})
                        assert r.status_code == 303, (verb, r.text)
                    owed = sql(fresh_db, "select count(*) from pgcoord.schedule_owed where name = %s", job)
                    assert owed == [(1,)]
                    assert sql(fresh_db, "select count(*) from pgcoord.schedule_pauses where name = %s",
                               job)[0][0] == 1
                    r = await client.post("/actions/resign", data={"name": election, "csrf": token})
                    assert r.status_code == 303, r.text
                    async with asyncio.timeout(10):
                        while sql(fresh_db, "select fence from pgcoord.leases where name = %s",
                                  election)[0][0] == fence:
                            await asyncio.sleep(0.05)
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename in ('{service}', '{operator}')")
            admin.execute(f"drop owned by {service}; drop owned by {operator};"
                          f" drop role {service}; drop role {operator}")


async def test_an_action_the_role_may_not_do_is_a_403_naming_the_privilege(fresh_db: str) -> None:
    import uuid

    import psycopg

    import pgcoord.migrations
    from pgcoord._core.resources import read_sql

    pgcoord.migrations.upgrade(fresh_db)
    suffix = uuid.uuid4().hex[:6]
    service, operator = f"svc_{suffix}", f"ops_{suffix}"
    with psycopg.connect(fresh_db, autocommit=True) as admin:
        admin.execute(f"create role {service} login; create role {operator} login")
        admin.execute(read_sql("roles.sql").replace("pgcoord_service", service)
                      .replace("pgcoord_operator", operator))
    job = unique("web-denied")
    sql(fresh_db, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    try:
        with serve(pgcoord.web.app(fresh_db.replace("postgres@", f"{operator}@"),
                                   access=lambda request: "all")) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                token = await _form(client, "/schedules")
                r = await client.post("/actions/trigger", data={"name": job, "csrf": token})
                assert r.status_code == 403 and "permission denied" in r.text and "Roles" in r.text
    finally:
        with psycopg.connect(fresh_db, autocommit=True) as admin:
            admin.execute(f"select pg_terminate_backend(pid) from pg_stat_activity"
                          f" where usename in ('{service}', '{operator}')")
            admin.execute(f"drop owned by {service}; drop owned by {operator};"
                          f" drop role {service}; drop role {operator}")


async def test_the_sampler_reads_the_schedules_again_only_when_they_moved(
        dsn: str, pool: asyncpg.Pool) -> None:
    """The lean schedules are the dear part of a reading (10,000 rows with their last
    run): a reading fetches them when their mark moved (a schedule changed, a slot
    started or ended), not every second; every change still changes the version."""
    from pgcoord.web.reader import Reader
    from pgcoord.web.sample import SchedulesKept, read_sample

    job = unique("web-kept")
    await pgcoord.Scheduler(pool).add(job, "0 0 * * *", handler="h")
    reader, kept = Reader(dsn), SchedulesKept()
    try:
        async def reading() -> Any:
            sample, _ = await read_sample(reader, with_terms=None, kept=kept)
            assert sample.error is None, sample.error
            return sample

        first = await reading()
        assert kept.reads == 1
        again = await reading()
        assert kept.reads == 1 and again.version == first.version
        sql(dsn, "insert into pgcoord.job_slots (job, slot_at, state, attempt, runner, started_at)"
                 " values (%s, now(), 'running', 1, 'r', now())", job)
        started = await reading()
        assert kept.reads == 2 and started.version != again.version
        assert [s["last_state"] for s in started.schedules if s["name"] == job] == ["running"]
        sql(dsn, "update pgcoord.job_slots set state = 'succeeded', finished_at = now() where job = %s", job)
        ended = await reading()
        assert kept.reads == 3 and [s["last_state"] for s in ended.schedules if s["name"] == job] == ["succeeded"]
        await pgcoord.Scheduler(pool).pause(job)
        paused_now = await reading()
        assert kept.reads == 4 and [s["paused"] for s in paused_now.schedules if s["name"] == job] == [True]
        await reading()
        assert kept.reads == 4
    finally:
        await reader.aclose()


async def test_the_csrf_cookie_is_secure_when_the_page_came_over_https(dsn: str) -> None:
    dashboard = pgcoord.web.app(dsn)
    try:
        for scheme, secure in (("https", True), ("http", False)):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=dashboard),
                                         base_url=f"{scheme}://ops.example") as client:
                cookie = (await client.get("/")).headers["set-cookie"]
                assert cookie.startswith("pgcoord_csrf=") and "httponly" in cookie.lower()
                assert ("; secure" in cookie.lower()) is secure, cookie
    finally:
        await pgcoord.web.aclose(dashboard)


_DOOMED_MEMBER = """
import asyncio, sys
import pgcoord

async def main(dsn, group, name):
    async with pgcoord.Member(dsn, group=group, name=name, ttl=30.0):
        print("JOINED", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:4]))
"""


async def _next_version(versions: list[str], within: float) -> float:
    """Seconds until an open stream's next event (the page's content changed)."""
    loop = asyncio.get_running_loop()
    first, started = len(versions), loop.time()
    async with asyncio.timeout(within):
        while len(versions) == first:
            await asyncio.sleep(0.02)
    return loop.time() - started


async def test_a_member_gone_and_a_slot_started_reach_an_open_stream_within_two_seconds(
        dsn: str, pool: asyncpg.Pool) -> None:
    """DESIGN §12's other live changes: a member whose process is SIGKILLed leaves the
    members page, and a slot that starts shows as running, each within 2 s of it,
    without a reload."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    group, name = unique("web-group"), unique("doomed")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", _DOOMED_MEMBER, dsn, group, name],
                            stdout=subprocess.PIPE, text=True, env=env)
    job, release = unique("web-slot"), asyncio.Event()
    scheduler = pgcoord.Scheduler(pool)

    @scheduler.cron(job, "0 0 1 1 *")
    async def handler(slot: Any) -> None:
        await release.wait()

    trigger: asyncio.Task[Any] | None = None
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "JOINED"
        with serve(pgcoord.web.app(dsn)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                versions: list[str] = []
                stream = asyncio.create_task(_sse_versions(client, versions, asyncio.Event()))
                try:
                    async with asyncio.timeout(5):
                        while not versions:
                            await asyncio.sleep(0.02)
                    members = await client.get("/members", headers={"X-Pgcoord-Fragment": "1"})
                    assert name in members.text
                    await asyncio.sleep(1.2)  # past the first readings: only news from here

                    proc.send_signal(signal.SIGKILL)
                    assert await _next_version(versions, 2.0) < 2.0
                    members = await client.get("/members", headers={"X-Pgcoord-Fragment": "1"})
                    assert name not in members.text
                    await asyncio.sleep(1.2)

                    trigger = asyncio.create_task(scheduler.trigger(job))
                    assert await _next_version(versions, 2.0) < 2.0
                    page = await client.get(f"/schedules/{quote(job, safe='')}",
                                            headers={"X-Pgcoord-Fragment": "1"})
                    assert page.status_code == 200 and "running" in page.text
                finally:
                    stream.cancel()
                    await asyncio.gather(stream, return_exceptions=True)
    finally:
        release.set()
        if trigger is not None:
            await asyncio.wait_for(asyncio.gather(trigger, return_exceptions=True), 10)
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
