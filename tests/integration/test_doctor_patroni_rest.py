"""``pgcoord doctor --patroni URL`` against REST APIs that answer badly: HTML, a 500,
basic auth, settings of types Patroni never gives, a body a byte at a time. The
database is real (the session's); the REST side is a small HTTP server of the test's
(the verdicts against a real Patroni cluster: tests/ha_patroni/test_patroni_doctor.py)."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from pgcoord.cli.doctor import Check
from pgcoord.cli.main import main

CONFIG = {"ttl": 30, "loop_wait": 10, "synchronous_mode": True}
CLUSTER = {"scope": "rest", "members": [
    {"name": "a", "role": "leader", "state": "running"},
    {"name": "b", "role": "replica", "state": "streaming", "lag": 0}]}
AUTH = "Basic " + base64.b64encode(b"doc:s3cret").decode()


class Api(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        mode = self.path.split("/")[1]
        what = self.path.split("/")[-1]
        body = json.dumps(CONFIG if what == "config" else CLUSTER).encode()
        if mode == "html":
            body = b"<html><body>a login page</body></html>"
        elif mode == "error":
            self.send_response(500)
            self.end_headers()
            return
        elif mode == "auth" and self.headers.get("Authorization") != AUTH:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="patroni"')
            self.end_headers()
            return
        elif mode == "types":
            body = json.dumps({"ttl": None, "loop_wait": "x"} if what == "config"
                              else {"members": "x"}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if mode == "drip":
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.5)
        else:
            self.wfile.write(body)


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def doctor(capsys: pytest.CaptureFixture[str], dsn: str, *args: str) -> tuple[int, dict[str, Check]]:
    code = main(["doctor", "--dsn", dsn, "--json", *args])
    out = json.loads(capsys.readouterr().out)
    return code, {c["name"]: Check(**c) for c in out["checks"]}


def test_basic_auth_in_the_url_is_sent_and_its_password_never_shown(
        dsn: str, api: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, checks = doctor(capsys, dsn, "--patroni", f"http://doc:s3cret@{api}/auth", "--ttl", "60")
    assert checks["patroni"].status == "pass", checks["patroni"]
    assert checks["patroni_members"].status == "pass"
    code, checks = doctor(capsys, dsn, "--patroni", f"http://doc:wrong@{api}/auth", "--ttl", "60")
    assert code == 2
    assert "Unauthorized" in checks["patroni"].detail, checks["patroni"]
    assert "wrong" not in json.dumps([c.detail for c in checks.values()])


@pytest.mark.parametrize(("mode", "said"), [
    ("html", "did not answer JSON"),
    ("error", "Internal Server Error"),
    ("types", "cannot read"),
    ("drip", "did not answer within"),
])
def test_a_rest_api_answering_badly_is_a_failure_line_beside_the_database_checks(
        dsn: str, api: str, capsys: pytest.CaptureFixture[str], mode: str, said: str) -> None:
    start = time.monotonic()
    code, checks = doctor(capsys, dsn, "--patroni", f"http://{api}/{mode}", "--ttl", "60")
    assert code == 2
    assert checks["patroni"].status == "fail" and said in checks["patroni"].detail, checks["patroni"]
    assert checks["schema"].status == "pass"  # the database's checks are all there
    assert time.monotonic() - start < 15  # a body a byte at a time: bounded, not minutes


@pytest.mark.parametrize("ttl", ["0", "-1", "abc", "nan", "inf", "1e300"])
def test_a_nonsense_ttl_is_a_usage_error(dsn: str, api: str, capsys: pytest.CaptureFixture[str],
                                         ttl: str) -> None:
    try:
        code = main(["doctor", "--dsn", dsn, "--patroni", f"http://{api}/ok", f"--ttl={ttl}"])
    except SystemExit as exited:  # argparse's own refusal
        code = exited.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert "--ttl" in captured.err and not captured.out and "Traceback" not in captured.err
