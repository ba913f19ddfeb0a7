"""``pgcoord web``: binds loopback by default, refuses a public address with neither
auth nor --read-only, and serves the dashboard (all actions, or read-only)."""

from __future__ import annotations

import os
import signal
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from .conftest import sql, unique


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGCOORD_WEB_")}
    return {**env, **extra}


@contextmanager
def running(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pgcoord.cli", "web", *args, "--port", str(port)],
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                httpx.get(url + "/static/style.css", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "pgcoord web did not start"
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "example.com", "::"])
def test_a_public_address_needs_auth_or_read_only(dsn: str, host: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pgcoord.cli", "web", "--dsn", dsn, "--host", host],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a loopback address" in lines[0] and "--read-only" in lines[0]


def test_half_configured_basic_auth_is_refused(dsn: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pgcoord.cli", "web", "--dsn", dsn],
                          env=_env(PGCOORD_WEB_USER="ops"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "PGCOORD_WEB_PASSWORD" in done.stderr


def _pause(url: str, job: str, client: httpx.Client) -> httpx.Response:
    page = client.get(url + "/schedules")
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
    assert token
    return client.post(url + "/actions/pause", data={"name": job, "csrf": token.group(1)})


def _add(dsn: str, job: str) -> None:
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)


def test_on_loopback_every_action_is_allowed(dsn: str) -> None:
    job = unique("cli-web")
    _add(dsn, job)
    with running("--dsn", dsn) as url, httpx.Client() as client:
        assert job in client.get(url + "/schedules").text
        assert _pause(url, job, client).status_code == 303
    assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(True,)]


def test_read_only_refuses_actions_and_basic_auth_guards_a_public_address(dsn: str) -> None:
    job = unique("cli-web-ro")
    _add(dsn, job)
    with running("--dsn", dsn, "--read-only") as url, httpx.Client() as client:
        assert _pause(url, job, client).status_code == 403
    env = _env(PGCOORD_WEB_USER="ops", PGCOORD_WEB_PASSWORD="pw")
    with running("--dsn", dsn, "--host", "0.0.0.0", env=env) as url:
        assert httpx.get(url + "/").status_code == 401
        assert httpx.get(url + "/", auth=("ops", "pw")).status_code == 200
    assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(False,)]


def test_ctrl_c_with_open_pages_ends_their_streams_at_once_and_quietly(dsn: str) -> None:
    """Open pages hold their event streams open: Ctrl-C ends them (no waiting for a
    graceful-shutdown timeout, no traceback per page cut) and the server exits."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pgcoord.cli", "web", "--dsn", dsn, "--port", str(port)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    streams: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                httpx.get(f"http://127.0.0.1:{port}/static/style.css", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "pgcoord web did not start"
                time.sleep(0.1)
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /events HTTP/1.1\r\nHost: pages\r\n\r\n")
            assert b"event: version" in s.recv(4096) or b"event: version" in s.recv(4096)
            streams.append(s)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        _, err = proc.communicate(timeout=15)
        took = time.monotonic() - started
        assert proc.returncode == 0, err
        assert took < 0.9, f"Ctrl-C took {took:.1f} s with 5 open pages"
        assert "Traceback" not in err and "Exception in ASGI application" not in err, err
        for s in streams:  # each page's stream was ended, not cut mid-response
            s.settimeout(2)
            tail = b""
            while chunk := s.recv(4096):
                tail += chunk
            assert tail.endswith(b"0\r\n\r\n"), tail[-40:]
    finally:
        for s in streams:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_worker_processes_sharing_pgcoord_web_secret_accept_each_others_forms(dsn: str) -> None:
    """Behind `uvicorn --workers N` a form drawn by one process is posted to another:
    with PGCOORD_WEB_SECRET set they share the CSRF key; without it each process has
    its own random key and refuses the other's token."""
    job = unique("cli-web-workers")
    _add(dsn, job)
    for secret, status in (("", 403), ("a shared secret of the deployment", 303)):
        env = _env(**({"PGCOORD_WEB_SECRET": secret} if secret else {}))
        with running("--dsn", dsn, env=env) as one, running("--dsn", dsn, env=env) as other, \
                httpx.Client() as client:
            page = client.get(one + "/schedules")
            token = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text)
            assert token
            r = client.post(other + "/actions/pause", data={"name": job, "csrf": token.group(1)},
                            cookies={"pgcoord_csrf": page.cookies["pgcoord_csrf"]})
            assert r.status_code == status, r.text
    assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(True,)]


def _reachable_address() -> str | None:
    """One of this host's non-loopback IPv4 addresses, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


def test_it_listens_on_loopback_only_unless_told_and_a_public_read_only_one_needs_no_auth(dsn: str) -> None:
    address = _reachable_address()
    with running("--dsn", dsn) as url:
        assert httpx.get(url + "/").status_code == 200
        if address is not None:  # the same port on the host's own address: not served
            port = url.rsplit(":", 1)[1]
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://{address}:{port}/", timeout=2)
    # A public address with --read-only and no basic auth: DESIGN §12 lets it start.
    with running("--dsn", dsn, "--host", "0.0.0.0", "--read-only") as url:
        assert httpx.get(url + "/").status_code == 200
        if address is not None:
            port = url.rsplit(":", 1)[1]
            assert httpx.get(f"http://{address}:{port}/", timeout=5).status_code == 200
