"""Where the dashboard reads from: a DSN (a small pool of its own, opened on first
use by the one DSN rule) or the application's own pool or engine, async or sync."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from .._core.errmap import schema_missing_raised, sqlstate
from .._drivers import adapt, release_sync, run_statement, tx_session_sync
from .._drivers.dsn import open_pool

#: Connections of a pool the dashboard opens itself: the sampler's, and a page's or
#: an action's own statement beside it.
POOL_SIZE = 3


class DatabaseError(Exception):
    """A page's or an action's statement the database refused or could not run (a
    timeout, a lock, a restart): a 503 saying why. The driver's error is its cause."""


def _refused(exc: BaseException) -> bool:
    return sqlstate(exc) is not None or isinstance(exc, OSError)


class Reader:
    """Runs one statement at a time in a transaction of its own; its first row."""

    def __init__(self, source: Any) -> None:
        self._dsn: str | None = None
        self._source: Any = None
        self._sync = False
        self._close: Callable[[], Awaitable[None]] | None = None
        self._opening: asyncio.Lock | None = None
        if isinstance(source, str):
            if not source.strip():
                raise ValueError("pgcoord.web.app() needs a DSN or a pool, not an empty string")
            self._dsn = source
        else:
            adapter = adapt(source)  # UnsupportedConnection for what no driver takes
            if not adapter.is_pool:
                raise TypeError(
                    "pgcoord.web.app() reads through a pool or an engine (it serves many requests "
                    "at once); pass the pool, the engine or a DSN, not one connection")
            self._source, self._sync = source, not adapter.is_async

    async def _pool(self) -> Any:
        if self._source is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._source is None:
                    assert self._dsn is not None
                    self._source, self._close = await open_pool(self._dsn, min_size=0,
                                                                max_size=POOL_SIZE)
        return self._source

    async def row(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
        try:
            source = await self._pool()
            if self._sync:
                return await asyncio.to_thread(_run_sync, source, sql, params)
            return await run_statement(source, sql, params)
        except Exception as exc:
            if not _refused(exc):
                raise
            raise DatabaseError(f"the database could not be read: {explain(exc)}") from exc

    async def value(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        row = await self.row(sql, params)
        return None if row is None else row[0]

    async def aclose(self) -> None:
        """Close the pool the dashboard opened itself (never the application's)."""
        close, self._close = self._close, None
        if close is not None:
            self._source = None
            await close()


def _run_sync(source: Any, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
    session = tx_session_sync(source)
    session.checkout()
    try:
        with schema_missing_raised():
            return session.run_autocommit(sql, params)
    finally:
        release_sync(session, rollback=False)


def explain(exc: BaseException) -> str:
    """One line: the error's type and its first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {text}"
