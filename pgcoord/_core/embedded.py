"""A throwaway PostgreSQL server for the demo, the tests and the benchmarks.

It uses the server binaries already on the machine (Debian keeps them in
/usr/lib/postgresql/<major>/bin, off PATH). initdb refuses to run as root, so
when we are root the server runs as the ``postgres`` user, or as a system user
created for the purpose when that one does not exist.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

_SERVER_USER_FALLBACK = "pgcoord-pg"

# Settings for a disposable server: durability off, room for the many short
# connections tests and benchmarks open, and pg_locks details on.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "max_connections": "300",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
}


#: Extra settings for every server started here, as ``name=value`` pairs separated by
#: spaces: CI's settings suite starts the tests' servers with production-like
#: timeouts (``lock_timeout=3s statement_timeout=30s ...``). Settings a server is too
#: old for are left out (``_SINCE``).
SETTINGS_ENV = "PGCOORD_TEST_SERVER_SETTINGS"
_SINCE = {"transaction_timeout": 17}


def env_settings(major: int | None = None) -> dict[str, str]:
    """The settings of ``SETTINGS_ENV``, less those a server of ``major`` lacks."""
    found: dict[str, str] = {}
    for pair in os.environ.get(SETTINGS_ENV, "").split():
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"{SETTINGS_ENV}: expected name=value pairs, got {pair!r}")
        if major is None or major >= _SINCE.get(name, 0):
            found[name] = value
    return found


class ServerNotFound(RuntimeError):
    pass


def find_bindir() -> Path:
    """Locate a directory holding ``initdb``, ``postgres`` and ``pg_isready``."""
    candidates: list[str] = []
    if env := os.environ.get("PGCOORD_PG_BINDIR"):
        candidates.append(env)
    for exe in ("initdb", "postgres"):
        if found := shutil.which(exe):
            candidates.append(str(Path(found).resolve().parent))
    versioned = glob.glob("/usr/lib/postgresql/*/bin")
    versioned.sort(key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                   reverse=True)
    candidates += [*versioned, "/usr/local/pgsql/bin"]
    for cand in candidates:
        d = Path(cand)
        if all((d / exe).is_file() for exe in ("initdb", "postgres", "pg_isready")):
            return d
    raise ServerNotFound(
        "no PostgreSQL server binaries found (looked for initdb/postgres in PGCOORD_PG_BINDIR, "
        "PATH and /usr/lib/postgresql/*/bin). Install them (Debian: apt-get install postgresql) "
        "or pass a DSN of a running server."
    )


def _server_user() -> pwd.struct_passwd | None:
    """The user to run the server as, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", _SERVER_USER_FALLBACK):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
         _SERVER_USER_FALLBACK],
        check=True,
    )
    return pwd.getpwnam(_SERVER_USER_FALLBACK)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class EmbeddedServer:
    """One PostgreSQL cluster in a temporary directory, stopped and removed on exit."""

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.bindir = find_bindir()
        extra = env_settings(self.major) if os.environ.get(SETTINGS_ENV) else {}
        self.settings = {**DEFAULT_SETTINGS, **extra, **(settings or {})}
        self.port = _free_port()
        self._user = _server_user()
        self._root = Path(tempfile.mkdtemp(prefix="pgcoord-pg-"))
        self.datadir = self._root / "data"
        self.logfile = self._root / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def major(self) -> int:
        """The server's major version (``postgres --version``)."""
        out = subprocess.run([str(self.bindir / "postgres"), "--version"], capture_output=True,
                             text=True, check=True).stdout
        found = re.search(r"\(PostgreSQL\) (\d+)", out)
        if found is None:
            raise RuntimeError(f"cannot read the server's version from {out!r}")
        return int(found.group(1))

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _as_server_user(self) -> dict[str, object]:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True, text=True, cwd=self._root, **self._as_server_user(),  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {result.stderr.strip() or result.stdout.strip()}")

    def start(self) -> EmbeddedServer:
        if self._user is not None:
            os.chown(self._root, self._user.pw_uid, self._user.pw_gid)
        if not self.datadir.exists():
            self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--locale=C", "--no-sync")
        self._spawn()
        return self

    def _spawn(self) -> None:
        args = [str(self.bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port),
                "-k", str(self._root)]
        for name, value in self.settings.items():
            args += ["-c", f"{name}={value}"]
        log = open(self.logfile, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self._root,
                start_new_session=True, **self._as_server_user(),  # type: ignore[call-overload]
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        isready = [str(self.bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)]
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"postgres exited at start:\n{self.log_tail()}")
            if subprocess.run(isready, check=False).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"postgres did not become ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def _shutdown(self, sig: signal.Signals, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self, *, immediate: bool = True) -> None:
        """Stop and start on the same port; every session is cut."""
        self._shutdown(signal.SIGQUIT if immediate else signal.SIGINT)
        self._spawn()

    def stop(self) -> None:
        self._shutdown(signal.SIGINT)
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def embedded_server(settings: Mapping[str, str] | None = None) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(settings) as server:
        yield server
