"""Where benchmarks run: a DSN from PGCOORD_BENCH_DSN, else a throwaway server."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pgcoord.migrations
from pgcoord._core.embedded import EmbeddedServer


@contextlib.contextmanager
def bench_database(settings: dict[str, str] | None = None) -> Iterator[tuple[str, EmbeddedServer | None]]:
    if dsn := os.environ.get("PGCOORD_BENCH_DSN"):
        pgcoord.migrations.upgrade(dsn)
        yield dsn, None
        return
    with EmbeddedServer(settings) as server:
        pgcoord.migrations.upgrade(server.dsn)
        yield server.dsn, server
