"""PgBouncer in transaction mode in front of the test server, for one test."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if Path("/usr/sbin/pgbouncer").exists()
                                          else None)
    if found is None:
        raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer); "
                           ".ci/run installs it")
    return found


class PgBouncer:
    def __init__(self, server_port: int, pool_mode: str = "transaction", extra: str = "") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pgcoord-pgbouncer-"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            f"""[databases]
* = host=127.0.0.1 port={server_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/users.txt
pool_mode = {pool_mode}
default_pool_size = 4
ignore_startup_parameters = extra_float_digits
logfile = {self.dir}/pgbouncer.log
pidfile = {self.dir}/pgbouncer.pid
{extra}"""
        )
        kwargs: dict[str, object] = {}
        if os.geteuid() == 0:  # pgbouncer refuses to run as root
            user = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            kwargs = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self.proc = subprocess.Popen(
            [find_pgbouncer(), str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kwargs,  # type: ignore[call-overload]
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"pgbouncer did not start: {self.log()}")

    def log(self) -> str:
        try:
            return (self.dir / "pgbouncer.log").read_text()[-2000:]
        except OSError:
            return ""

    def dsn(self, dsn: str) -> str:
        host_port = dsn.split("@", 1)[1].split("/", 1)[0]
        return dsn.replace(host_port, f"127.0.0.1:{self.port}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
