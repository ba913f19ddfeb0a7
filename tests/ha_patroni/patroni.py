"""etcd and two Patroni nodes on loopback, for the Patroni tests and ``bench/ha.py``.

Patroni comes from its own venv (``PGCOORD_PATRONI_VENV``, default
``/opt/pgcoord-patroni``; .ci/patroni.sh makes it: ``patroni[psycopg3,etcd3]`` in a
venv of ``/usr/bin/python3``, which the postgres user can run), etcd from Debian's
``etcd-server`` (``PGCOORD_ETCD``, default ``/usr/bin/etcd``). When either is missing
the harness raises: a missing tool fails the tests, it never skips them.

Everything runs as the postgres user when we are root (PostgreSQL refuses root),
binds to 127.0.0.1 only, and lives in one temporary directory. Ports are chosen
below the ephemeral range (32768-60999 on Linux): a restarted etcd must get its
port back, and an outgoing connection's ephemeral port in TIME_WAIT could hold it.

``stop()`` removes everything on every path (an ``atexit`` hook too): Patroni is
asked to stop, then its process group is killed, then any postmaster left (Patroni
starts each in a session of its own) is killed by its ``postmaster.pid``, then etcd.
A process that is killed outright (a CI job's timeout: SIGTERM, SIGKILL) runs no
``atexit`` hook, and everything here runs in sessions of its own: a reaper process,
started first, does the same when its pipe from us closes without a word (``REAPER``).

The events: ``switchover()`` (``patronictl switchover --force``), ``kill_primary()``
(SIGKILL to the primary's postmaster; with ``primary_start_timeout: 0`` Patroni fails
over instead of restarting it in place) and ``etcd_outage(seconds)`` (etcd stopped,
then started again on its port and data: Patroni demotes the primary to read-only,
unless ``failsafe_mode`` keeps it writable).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg

from pgcoord._core.embedded import find_bindir

VENV_ENV = "PGCOORD_PATRONI_VENV"
DEFAULT_VENV = "/opt/pgcoord-patroni"
ETCD_ENV = "PGCOORD_ETCD"
# The tools Patroni runs besides postgres itself.
_PG_TOOLS = ("initdb", "postgres", "pg_ctl", "pg_basebackup", "pg_rewind", "pg_controldata",
             "pg_isready")


def patroni_venv() -> Path:
    venv = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)
    if not (venv / "bin" / "patroni").is_file():
        raise RuntimeError(
            f"Patroni not found in {venv} ({VENV_ENV}): make it with `bash .ci/patroni.sh` "
            f"(a venv of /usr/bin/python3 with patroni[psycopg3,etcd3]) or point {VENV_ENV} at one")
    return venv


def etcd_binary() -> Path:
    etcd = Path(os.environ.get(ETCD_ENV) or shutil.which("etcd") or "/usr/bin/etcd")
    if not etcd.is_file():
        raise RuntimeError(f"etcd not found ({ETCD_ENV}, PATH, /usr/bin/etcd): "
                           "apt-get install etcd-server, or `bash .ci/patroni.sh`")
    return etcd


def pg_bindir() -> Path:
    """A bindir with every tool Patroni runs (Debian's: the PyPI servers of CI lack
    pg_rewind or pg_basebackup)."""
    for bindir in (find_bindir(), *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)):
        if all((bindir / tool).is_file() for tool in _PG_TOOLS):
            return bindir
    raise RuntimeError(f"no PostgreSQL bindir with {', '.join(_PG_TOOLS)} "
                       "(Debian: apt-get install postgresql)")


_taken: set[int] = set()


def _free_low_port() -> int:
    """A free port below the ephemeral range, on 127.0.0.1."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port in 20000-32000")


# The reaper: reads "pgid N" (a process group to kill), "forget N" and "datadir PATH"
# (whose postmaster.pid names a postmaster to kill) from its stdin; at "done" it exits;
# at end of input without it (the test process died), it kills them all, then removes
# the cluster's directory (argv[1]).
REAPER = """
import os, shutil, signal, sys
groups, datadirs = set(), []
for line in sys.stdin:
    what, _, arg = line.strip().partition(" ")
    if what == "done":
        sys.exit(0)
    if what == "pgid":
        groups.add(int(arg))
    elif what == "forget":
        groups.discard(int(arg))
    elif what == "datadir":
        datadirs.append(arg)
postmasters = []
for d in datadirs:
    try:
        postmasters.append(int(open(os.path.join(d, "postmaster.pid")).readline()))
    except (OSError, ValueError):
        pass
for pid in [*groups, *postmasters]:  # Patroni first: it would start postgres again
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


def _server_user() -> pwd.struct_passwd | None:
    return pwd.getpwnam("postgres") if os.geteuid() == 0 else None


class Node:
    def __init__(self, cluster: PatroniCluster, name: str) -> None:
        self.name = name
        self.port = _free_low_port()
        self.api_port = _free_low_port()
        self.dir = cluster.root / name
        self.datadir = self.dir / "data"
        self.config = self.dir / "patroni.yml"
        self.log = self.dir / "patroni.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=3"

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.datadir / "postmaster.pid").read_text().splitlines()[0])
        return None


class PatroniCluster:
    """etcd and two Patroni nodes: a primary and a synchronous standby.

    ``ttl`` 20 is Patroni's least (it raises a smaller one to 20, config.py): a
    primary lost without a word (its host gone) is replaced within ttl + loop_wait.
    ``primary_start_timeout: 0``: a crashed postmaster is failed over at once, not
    restarted in place for 300 s."""

    def __init__(self, *, ttl: int = 20, loop_wait: int = 2, retry_timeout: int = 4,
                 synchronous: bool = True, failsafe: bool = False,
                 maximum_lag_on_failover: int = 1048576) -> None:
        self.venv = patroni_venv()
        self.etcd_bin = etcd_binary()
        self.bindir = pg_bindir()
        self.user = _server_user()
        self.dcs = {"ttl": ttl, "loop_wait": loop_wait, "retry_timeout": retry_timeout,
                    "synchronous_mode": synchronous, "failsafe_mode": failsafe,
                    "maximum_lag_on_failover": maximum_lag_on_failover,
                    "primary_start_timeout": 0}
        self.scope = f"pgcoord-{uuid.uuid4().hex[:6]}"
        self.root = Path(tempfile.mkdtemp(prefix="pgcoord-patroni-"))
        self.etcd_port = _free_low_port()
        self.etcd_peer_port = _free_low_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.nodes = [Node(self, "n0"), Node(self, "n1")]
        self._stopped = False
        atexit.register(self.stop)
        self._reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(self.root)],
                                        stdin=subprocess.PIPE, text=True, start_new_session=True)
        for node in self.nodes:
            self._reap(f"datadir {node.datadir}")

    def _reap(self, line: str) -> None:
        """Tell the reaper (see REAPER)."""
        stdin = self._reaper.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.write(line + "\n")
                stdin.flush()

    # -- the multi-host DSNs of tests/integration/ha.py's StandbyPair ---------------------

    def libpq_dsn(self, dbname: str = "postgres") -> str:
        a, b = (n.port for n in self.nodes)
        return (f"host=127.0.0.1,127.0.0.1 port={a},{b} user=postgres dbname={dbname}"
                " target_session_attrs=read-write connect_timeout=3")

    def url(self, dbname: str = "postgres", scheme: str = "postgresql") -> str:
        a, b = (n.port for n in self.nodes)
        return (f"{scheme}://postgres@127.0.0.1:{a},127.0.0.1:{b}/{dbname}"
                "?target_session_attrs=read-write")

    def sqlalchemy_url(self, dbname: str = "postgres", driver: str = "asyncpg") -> str:
        a, b = (n.port for n in self.nodes)
        return (f"postgresql+{driver}://postgres@/{dbname}?host=127.0.0.1:{a}"
                f"&host=127.0.0.1:{b}&target_session_attrs=read-write")

    @property
    def api_urls(self) -> list[str]:
        return [n.api for n in self.nodes]

    # -- life cycle ----------------------------------------------------------------------

    def _as_user(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _chown(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    def start(self) -> PatroniCluster:
        try:
            self._chown(self.root)
            os.chmod(self.root, 0o700)
            self.start_etcd()
            for node in self.nodes:
                node.dir.mkdir()
                self._chown(node.dir)
                node.config.write_text(json.dumps(self._config(node), indent=1))  # YAML reads JSON
                self._chown(node.config)
            self._spawn(self.nodes[0])
            self.wait_writable(timeout=60)
            self._spawn(self.nodes[1])
            self.wait_healthy(timeout=90)
        except BaseException:
            self.stop()
            raise
        return self

    def _config(self, node: Node) -> dict[str, Any]:
        auth = {"superuser": {"username": "postgres", "password": "pgcoord"},
                "replication": {"username": "replicator", "password": "pgcoord"},
                "rewind": {"username": "postgres", "password": "pgcoord"}}
        return {
            "scope": self.scope, "namespace": "/pgcoord/", "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{node.api_port}",
                        "connect_address": f"127.0.0.1:{node.api_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {**self.dcs, "postgresql": {
                    "use_pg_rewind": True, "use_slots": True,
                    "parameters": {"wal_level": "replica", "hot_standby": "on",
                                   "max_wal_senders": 5, "max_replication_slots": 5,
                                   "wal_log_hints": "on", "max_connections": 200,
                                   "shared_buffers": "32MB", "synchronous_commit": "on",
                                   "wal_sender_timeout": "5s", "wal_receiver_status_interval": "1s",
                                   "max_locks_per_transaction": 128}}},
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "no-sync"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.datadir), "bin_dir": str(self.bindir),
                "pgpass": str(node.dir / "pgpass"),
                "authentication": auth,
                "parameters": {"unix_socket_directories": str(node.dir)},
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "tags": {},
        }

    def _spawn(self, node: Node) -> None:
        log = open(node.log, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            node.proc = subprocess.Popen(
                [str(self.venv / "bin" / "patroni"), str(node.config)], stdout=log, stderr=log,
                stdin=subprocess.DEVNULL, cwd=node.dir, start_new_session=True, **self._as_user())
        finally:
            log.close()
        self._reap(f"pgid {node.proc.pid}")

    def start_etcd(self) -> None:
        data = self.root / "etcd"
        client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{self.etcd_peer_port}"
        log = open(self.root / "etcd.log", "ab")  # noqa: SIM115
        try:
            self.etcd = subprocess.Popen(
                [str(self.etcd_bin), "--name", "e0", "--data-dir", str(data),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"e0={peer}", "--initial-cluster-state", "new"],
                stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.root,
                start_new_session=True, **self._as_user())
        finally:
            log.close()
        self._reap(f"pgid {self.etcd.pid}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.etcd.poll() is not None:
                raise RuntimeError(f"etcd exited:\n{self.tail(self.root / 'etcd.log')}")
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(f"{client}/health", timeout=1) as resp:
                if json.load(resp).get("health") == "true":
                    return
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy in 30s:\n{self.tail(self.root / 'etcd.log')}")

    def stop_etcd(self) -> None:
        proc, self.etcd = self.etcd, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc is not None:
            self._reap(f"forget {proc.pid}")

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()  # Patroni stops its postgres (fast) and exits
        for node in self.nodes:
            if node.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait()
        for node in self.nodes:
            pid = node.postmaster_pid()
            if pid is not None:
                # its own session: kill the whole of it, backends too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.stop_etcd()
        self._reap("done")
        if self._reaper.stdin is not None:
            self._reaper.stdin.close()
        self._reaper.wait()
        if not os.environ.get("PGCOORD_PATRONI_KEEP"):  # to read the logs afterwards
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PatroniCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the REST API says ----------------------------------------------------------

    def rest(self, node: Node, path: str) -> Any:
        with urllib.request.urlopen(f"{node.api}{path}", timeout=2) as resp:
            return json.load(resp)

    def cluster_state(self) -> dict[str, Any]:
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                state: dict[str, Any] = self.rest(node, "/cluster")
                return state
        raise RuntimeError("no Patroni REST API answers")

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def writable(self) -> Node | None:
        """The node that takes writes now, asked of PostgreSQL itself."""
        for node in self.nodes:
            with contextlib.suppress(psycopg.Error), \
                    psycopg.connect(node.dsn, autocommit=True, connect_timeout=1) as conn:
                if conn.execute("select pg_is_in_recovery()").fetchone() == (False,):
                    return node
        return None

    def wait_writable(self, timeout: float = 60, poll: float = 0.05) -> Node:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (node := self.writable()) is not None:
                try:
                    with psycopg.connect(node.dsn, autocommit=True, connect_timeout=1) as conn:
                        conn.execute("create temporary table pgcoord_probe (x int)")
                    return node
                except psycopg.Error:
                    pass
            self._check_alive()
            time.sleep(poll)
        raise RuntimeError(f"no writable primary in {timeout}s:\n{self.logs()}")

    def wait_healthy(self, timeout: float = 60) -> Node:
        """A writable primary and the other node streaming as its synchronous standby
        (with ``synchronous_mode``; streaming otherwise)."""
        want = "sync" if self.dcs["synchronous_mode"] else "async"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            node = self.writable()
            if node is not None:
                with contextlib.suppress(psycopg.Error), \
                        psycopg.connect(node.dsn, autocommit=True, connect_timeout=1) as conn:
                    rows = conn.execute("select application_name, state, sync_state"
                                        " from pg_stat_replication").fetchall()
                    other = next(n.name for n in self.nodes if n is not node)
                    # Patroni's own view too: it names the synchronous standby in the DCS
                    # after the server does, and only that one may take over.
                    if (other, "streaming", want) in rows and self._member_role(other) in \
                            ({"sync_standby"} if want == "sync" else {"replica"}):
                        return node
            self._check_alive()
            time.sleep(0.1)
        raise RuntimeError(f"no primary with a {want} streaming standby in {timeout}s:\n{self.logs()}")

    def _member_role(self, name: str) -> str | None:
        with contextlib.suppress(RuntimeError):
            for member in self.cluster_state().get("members", []):
                if member.get("name") == name:
                    return str(member.get("role"))
        return None

    def _check_alive(self) -> None:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError(f"patroni {node.name} exited:\n{self.logs()}")

    # -- events --------------------------------------------------------------------------

    def patronictl(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.venv / "bin" / "patronictl"), "-c", str(self.nodes[0].config), *args],
            capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"patronictl {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def switchover(self) -> Node:
        """``patronictl switchover`` to the other node; returns the new primary's node."""
        leader = self.wait_writable()
        candidate = next(n for n in self.nodes if n is not leader)
        self.last_output = self.patronictl("switchover", self.scope, "--leader", leader.name,
                                           "--candidate", candidate.name, "--force")
        return candidate

    def kill_primary(self) -> Node:
        """SIGKILL to the primary's postmaster; returns the node killed."""
        leader = self.wait_writable()
        pid = leader.postmaster_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        return leader

    def edit_config(self, **settings: Any) -> None:
        """Change the cluster's dynamic configuration (PATCH /config)."""
        req = urllib.request.Request(f"{self.nodes[0].api}/config", method="PATCH",
                                     data=json.dumps(settings).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()
        self.dcs.update(settings)
        # Each node reads the DCS once a loop: until every running one shows it.
        deadline = time.monotonic() + 30
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            while True:
                with contextlib.suppress(OSError, ValueError):
                    config = self.rest(node, "/config")
                    if all(config.get(k) == v for k, v in settings.items()):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} does not show {settings} after 30s")
                time.sleep(0.1)

    def stop_node(self, node: Node) -> None:
        """Patroni on ``node`` and its postgres stopped (a standby gone)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.terminate()
            node.proc.wait(30)
        if node.proc is not None:
            self._reap(f"forget {node.proc.pid}")
        pid = node.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)

    def start_node(self, node: Node) -> None:
        self._spawn(node)

    def kill_primary_agent(self, down: float) -> Node:
        """SIGKILL to the primary's Patroni (not its postgres), started again ``down``
        seconds later, as a service manager restarts it; the primary's node."""
        node = self.wait_writable()
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()
        self._reap(f"forget {node.proc.pid}")
        time.sleep(down)
        self._spawn(node)
        return node

    # -- diagnostics ---------------------------------------------------------------------

    @staticmethod
    def tail(path: Path, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def logs(self) -> str:
        return "\n".join(f"--- {n.name}:\n{self.tail(n.log)}" for n in self.nodes) + \
            f"\n--- etcd:\n{self.tail(self.root / 'etcd.log', 10)}"

    def etcd_outage(self, seconds: float) -> None:
        """etcd stopped for ``seconds``, then started again on its port and data."""
        self.stop_etcd()
        time.sleep(seconds)
        self.start_etcd()
