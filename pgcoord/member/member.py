"""``Member``: a process's presence in the database, and crash news in milliseconds.

A member is one dedicated *main* session that holds the member's alive lock
(see ``sql/0004_members.up.sql``) and, while something needs it, hears membership
news: the members of one process share one listening session (``news_hub.py``). The server
releases that lock the moment the session ends: the process died, the session
was terminated, the server restarted, or the server itself ended a silent
session (``idle_session_timeout``, 0.9 x ttl, after a pause or a partition).

Who notices? Members of a group form a ring ordered by id. Each member's second
session, the *watcher*, waits in the lock queue for its successor's alive lock.
When the successor's session ends the watcher is granted the lock at once; the
member deletes the successor's row, announces ``left`` with NOTIFY to everyone,
gives the lock back and moves on to the next successor. Simultaneous deaths of
neighbours are found one after another by the same watcher, each in one round
trip. A watcher that was paused itself when its target died holds the dead
member's lock until the server ends the paused session; meanwhile every live
member's heartbeat (every ttl/3) sweeps the group for rows whose own session no
longer holds their lock, so that death is told within ttl/3 even then.

Failure detection bounds (measured by ``bench/members.py``): a death that ends
the session (SIGKILL, ``pg_terminate_backend``) is told in one lock grant plus
one NOTIFY; a silent member within 0.9 x ttl of its last heartbeat; a death
whose watcher is itself paused within ttl/3 more.

A member uses exactly two server connections, whatever else runs on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from .._core import errmap as _errmap
from .._core import readonly
from .._core.aio import END_OF_STREAM, Backoff, Subscription, Supervisor, finish_despite_cancel
from .._core.queries import query
from .._drivers.dedicated import DsnSource, HolderConnection, behind_transaction_pooler
from ..errors import SchemaMissing
from .channels import Channels
from .info import (
    MemberChange,
    MemberInfo,
    MemberJoined,
    MemberLeft,
    NameTaken,
    _add_hook,
    _as_reason,
    _info,
    _validate,
)
from .news_hub import NewsHub, hub_for
from .ring import RingWatch
from .session import MemberSession, SessionLost

__all__ = ["Member", "MemberWatch"]

log = logging.getLogger("pgcoord.member")

CHANNEL = "pgcoord_members"


def _process() -> str:
    """This process, as member rows name it (``client``): members of one process die
    together, and their deaths are told together (``member_wait_reap``, 0011)."""
    return f"{socket.gethostname()}:{os.getpid()}"


#: What cuts a statement of the member's short without saying anything of its session.
_BUSY = (_errmap.SQLSTATE_LOCK_NOT_AVAILABLE, _errmap.SQLSTATE_QUERY_CANCELED)



class Member:
    """One process's presence in a group; see docs/members.md."""

    def __init__(
        self, dsn: str, *, group: str = "default", name: str | None = None,
        meta: dict[str, Any] | None = None, ttl: float = 10.0, driver: str | None = None,
        application_name: str | None = None,
    ) -> None:
        if not isinstance(dsn, str):
            raise TypeError("Member takes a DSN: it needs sessions of its own, never a pool's")
        self.group, self.name, self._meta_json, self.ttl = _validate(group, name, meta, ttl)
        self.meta: dict[str, Any] = json.loads(self._meta_json)
        self.application_name = (application_name or f"pgcoord-member:{self.name}")[:63]
        self._source = DsnSource(dsn, driver, keepalive=self.ttl)
        self._dsn = dsn
        #: Shared by this process's members of the same database (``news_hub.py``):
        #: set at open(), in the running event loop.
        self._hub = NewsHub()
        #: This member's id while joined; a new one after each rejoin.
        self.id: int | None = None
        self.joined_at: dt.datetime | None = None
        self._main: HolderConnection | None = None
        self._main_io = asyncio.Lock()
        self._view: dict[int, MemberInfo] = {}
        self._left_hooks: list[Callable[[int], None]] = []
        self._lost_hooks: list[Callable[[int], None]] = []
        #: What features listen to on the member's session, and what it LISTENs to.
        self._channels = Channels(self.name)
        #: LockHolders on this member share its session, and session locks are
        #: re-entrant per session: their per-key FIFO must be the member's.
        self.holder_queues: dict[int, Any] = {}
        self._subscribers: set[asyncio.Queue[MemberChange]] = set()
        self._news = asyncio.Event()
        self._lost = asyncio.Event()
        self._joined = asyncio.Event()
        #: True behind a transaction-mode pooler: heartbeat rows, no session.
        self.polling: bool | None = None
        self._tasks = Supervisor(f"member {self.name!r}", log)
        self._ring = RingWatch(self.name, self.ttl, lambda: self.id, self._call, self._spawn,
                               self._forget)
        self._ring.fresh_ring = self._read_ring
        self._runner: asyncio.Task[None] | None = None
        self._open = False

    # -- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Member:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        """Join the group; returns once joined (raises if the first join fails)."""
        if self._open:
            raise RuntimeError("this Member is already open")
        self._open = True
        self._hub = hub_for(self._dsn)
        backoff = Backoff(first=0.05, cap=min(1.0, self.ttl / 3))
        try:
            while True:
                try:
                    await self._join()
                    break
                except Exception as exc:
                    await finish_despite_cancel(self._drop_sessions())
                    if _errmap.sqlstate(exc) not in _BUSY:
                        raise
                    # pgcoord's table locked past the session's own 500 ms lock_timeout
                    # (a migration's ALTER TABLE, an operator's transaction), or an
                    # operator's cancel: the database is there and the join may be
                    # made; as a rejoin would, try again (the caller bounds the wait).
                    delay = backoff.failed()
                    log.warning("member %r: joining was cut short (%r); trying again in %.2fs",
                                self.name, exc, delay)
                    await backoff.sleep()
        except BaseException:
            self._open = False
            await finish_despite_cancel(self._drop_sessions())
            raise
        self._runner = asyncio.create_task(self._run(), name=f"pgcoord-member:{self.name}")

    async def close(self) -> None:
        """Leave the group (announced as ``left``) and close both sessions."""
        if not self._open:
            return
        self._open = False
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner
        await self._stop_tasks()
        # Whatever is tied to this session stops believing before the session is
        # given up (followers may take over the moment we have left).
        if self.id is not None:
            self._call_hooks(self._lost_hooks, self.id)
        try:
            with contextlib.suppress(Exception):
                await finish_despite_cancel(self._leave())
            with contextlib.suppress(Exception):
                await finish_despite_cancel(self._end_watch())
        finally:
            await finish_despite_cancel(self._drop_sessions())
            for queue in self._subscribers:
                queue.put_nowait(END_OF_STREAM)

    async def _leave(self) -> None:
        if self.id is not None and self._main is not None and not self._lost.is_set():
            try:
                await self._call(query("member_leave"), self.id)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # Not a cancellation of ours: asyncpg 0.29 makes the statement after a
                # cancelled one wait for that cancel, and the wait can end this way
                # when the tasks that ran on the session were stopped. Leaving is best
                # effort: the session is closed next, and its end frees the alive lock
                # (the others are told the member crashed rather than left).
                log.warning("member %r: leaving the group was cut short; closing the session", self.name)
            except SessionLost:
                pass  # its end frees the alive lock: the others are told it crashed
            except Exception as exc:
                # Its row stays unmarked until the session's end is found: the others
                # are told it crashed, not that it left.
                log.warning("member %r: saying goodbye failed (%r); closing the session", self.name, exc)

    async def _end_watch(self) -> None:
        """Cut short the statement the watcher's stopped task left on the server (its
        sleep, or its wait in a lock queue). The server does not see a closed socket
        while a statement runs: it looks every client_connection_check_interval (a
        second), and the backend would hold the watcher's locks until then."""
        watcher = self._ring.session
        if watcher is not None and self._main is not None and not self._lost.is_set():
            await self._call(query("member_cancel_watch"), watcher.backend_pid)

    async def _drop_sessions(self) -> None:
        self._hub.unregister(self)  # another member of the process carries the news
        for conn in (self._ring.session, self._main):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close_now()
        self._ring.session = self._main = None
        self._channels.session_gone()
        self.id = None
        self._joined.clear()

    async def _stop_tasks(self) -> None:
        await self._tasks.stop()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        # The member reads its loops' outcomes itself (_run logs them).
        return self._tasks.spawn(coro, name, collected=True)

    # -- sessions ------------------------------------------------------------------------

    @property
    def _idle_ms(self) -> int:
        # As for the elector: the member speaks every ttl/3, and the server ends
        # its session after 0.9 ttl of silence, inside the one-ttl bound.
        return int(self.ttl * 900)

    async def _open_session(self, role: str) -> HolderConnection:
        """A session of ours, set up unless it turns out to be behind a
        transaction-mode pooler (where session settings would leak to other
        clients of the same server session); ``self.polling`` says which."""
        conn = await self._source.open()
        try:
            await conn.prepare()
            conn.backend_pid = int(await conn.fetchval(query("holder_backend_pid")))
            if role == "":
                self.polling = await behind_transaction_pooler(self._source, conn)
            if not self.polling:
                idle = str(max(1, int(self.ttl / 2)))
                await conn.fetchval(
                    query("holder_setup"), f"{self.application_name}"[: 63 - len(role)] + role,
                    idle, idle, str(int(self.ttl * 1000)),
                )
                setup = "member_session" if role == "" else "member_watcher_session"
                await conn.execute(query(setup).format(idle_ms=self._idle_ms))
        except BaseException:
            await finish_despite_cancel(conn.close_now())
            raise
        return conn

    async def _join(self) -> None:
        """Open the sessions, LISTEN, join, and load the view. Behind a
        transaction-mode pooler: one connection, no alive lock, no LISTEN."""
        lost = asyncio.Event()
        main = await self._open_session("")
        self._main = main
        # The new session's event from now on: the last session's, set, would say this
        # one cannot carry the process's news (``can_carry``), and the join would not
        # listen before it joins.
        self._lost = lost
        main.on_lost(lost.set)
        try:
            if self.polling:
                log.warning(
                    "member %r: a transaction-mode pooler is in between; membership falls back "
                    "to heartbeat rows: departures are told within ttl + ttl/3, not at once",
                    self.name)
            elif self._needs_news():
                # Before joining, so that no news after our join is missed: through
                # the process's listening session, or on ours if nobody listens.
                self._hub.register(self)
                if self._hub.carries(self):
                    await self._channels.listen_first(main, CHANNEL, self._hub.dispatch)
            with _errmap.schema_missing_raised():
                try:
                    row = await main.fetchval(
                        "SELECT pg_catalog.row_to_json(j)::text FROM ("
                        + query("member_join") + ") AS j",
                        self.group, self.name, self._meta_json, int(self.ttl * 1000),
                        self.application_name, not self.polling, _process(),
                    )
                except Exception as exc:
                    if _errmap.sqlstate(exc) == _errmap.SQLSTATE_NAME_TAKEN:
                        raise NameTaken(
                            f"a live member of group {self.group!r} is already named {self.name!r}"
                        ) from None
                    raise
            joined = json.loads(row)
            self.id = int(joined["id"])
            self.joined_at = dt.datetime.fromisoformat(joined["joined_at"])
            if not self.polling:
                self._ring.use(await self._open_session("/watch"))
        except BaseException:
            if self.id is not None:
                # Joined, but cut short before it was done (close() while the member
                # joins again, a watcher session that would not open): say goodbye on
                # the session that joined. Dropped unmarked, the row was a dead member
                # nobody had told, found later by any reap and told as 'crashed'.
                with contextlib.suppress(Exception):
                    await finish_despite_cancel(self._leave())
            await finish_despite_cancel(self._drop_sessions())
            raise
        self._channels.new_session()
        if CHANNEL in self._listening:
            self._hub.listening(self)
        await self._refresh(initial=True)
        await self._listen_all()  # and no longer on membership news if not alone
        if not self.polling:
            await self._ring.tell_predecessor()
        self._joined.set()
        log.info("member %r joined group %r as id %d", self.name, self.group, self.id)

    async def _call(self, sql: str, *args: Any, how: str = "val") -> Any:
        """One statement on the main session, serialised with every other user of
        it: its first value (``how="val"``), first row (``"row"``) or nothing
        (``"exec"``, parameterless). ``SessionLost`` when the session is gone."""
        conn = self._main
        if conn is None or self._lost.is_set():
            raise SessionLost("the member's session is gone")
        async with self._main_io:
            if self._lost.is_set():
                raise SessionLost("the member's session is gone")
            try:
                if how == "row":
                    return await conn.fetchrow(sql, *args)
                if how == "exec":
                    return await conn.execute(sql)
                return await conn.fetchval(sql, *args)
            except Exception as exc:
                if _errmap.session_gone(exc):
                    self._lost.set()
                    raise SessionLost(repr(exc)) from exc
                raise

    @property
    def has_session(self) -> bool:
        """True while the member is joined with a live session (for readiness probes):
        False while it is joining again after a lost session, or closed."""
        return (self._open and self._main is not None and self.id is not None
                and self._joined.is_set() and not self._lost.is_set())

    def session(self) -> MemberSession:
        """The member's current session, for a feature that runs on it (an
        elector, a lock holder): ``SessionLost`` if there is none right now."""
        if self._main is None or self.id is None or self._lost.is_set() or not self._joined.is_set():
            raise SessionLost("the member has no session right now (it is joining)")
        return MemberSession(self, self.id, self._main)

    async def wait_joined(self) -> None:
        """Until the member has a session (at once when it has).

        A session found lost that the member's loop has not dropped yet is not one:
        returning at once then made a caller that loops on ``session()`` (a member
        lease's acquire) spin without yielding, so the loop never got to drop it and
        the process froze (a Patroni switchover, tests/ha_patroni)."""
        if not self._open:
            raise RuntimeError("Member is not open: use `async with Member(...)` or open()")
        while True:
            await self._joined.wait()
            if not self._lost.is_set():
                return
            # _run stops the lost session's tasks, then clears _joined: a short wait.
            await asyncio.sleep(0.02)

    # -- the background work ----------------------------------------------------------------

    async def _run(self) -> None:
        """Heartbeat, watch the successor and apply news; rejoin after a lost session."""
        backoff = Backoff(first=0.05, cap=self.ttl / 3)
        while True:
            try:
                if self._main is None:
                    await self._join()
                    readonly.writable(f"member:{id(self)}")
                    backoff.reset()
                parts = [self._spawn(self._heartbeat_loop(), f"pgcoord-member-heartbeat:{self.name}")]
                if not self.polling:
                    parts += [
                        self._spawn(self._watch(), f"pgcoord-member-watch:{self.name}"),
                        self._spawn(self._news_loop(), f"pgcoord-member-news:{self.name}"),
                    ]
                lost_wait = asyncio.ensure_future(self._lost.wait())
                try:
                    await asyncio.wait([lost_wait, *parts], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    lost_wait.cancel()
                for part in parts:
                    if part.done() and not part.cancelled() and part.exception() is not None:
                        log.warning("member %r: %r", self.name, part.exception())
                log.warning("member %r (id %s): session lost; joining again", self.name, self.id)
            except Exception as exc:
                # Never give up in the background: open() already raised for a
                # schema that was missing at the start; one that goes missing
                # later (a restore, a downgrade) is logged loudly and retried.
                delay = backoff.failed()
                message = "member %r: %r; joining again in %.2fs"
                if isinstance(exc, SchemaMissing):
                    log.error(message, self.name, exc, delay)
                else:
                    readonly.retrying(log, exc, message, self.name, exc, delay, key=f"member:{id(self)}")
            self._hub.unregister(self)  # at once: the process's other members need news now
            own_id = self.id
            if own_id is not None:
                self._call_hooks(self._lost_hooks, own_id)
            await self._stop_tasks()
            await finish_despite_cancel(self._drop_sessions())
            self._forget_view(own_id)
            await backoff.sleep()

    async def _watch(self) -> None:
        """The ring watch, for as long as the main session lives. Only a lost main
        session ends the member: a watcher session that fails (an operator or a tool
        ended what looked like a long-waiting query, an error of its own) is closed
        and another one opened, under the same id. Meanwhile the heartbeat's sweep
        still tells deaths, within ttl/3."""
        backoff = Backoff(first=0.05, cap=self.ttl / 3)
        while True:
            try:
                if self._ring.session is None:
                    self._ring.use(await self._open_session("/watch"))
                    log.info("member %r (id %s): watching again on a new session", self.name, self.id)
                if self._lost.is_set():
                    return
                await self._ring.run()
            except Exception as exc:
                if not self._lost.is_set():
                    log.warning("member %r (id %s): its watcher failed (%r); opening another",
                                self.name, self.id, exc)
                    backoff.failed()
            # Closed now, not when the member drops its sessions: a watcher granted
            # a lock must not hold it a moment longer than its watch.
            watcher, self._ring.session = self._ring.session, None
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await finish_despite_cancel(watcher.close_now())
            if self._lost.is_set():
                return  # the main session went too: the member joins again
            await backoff.sleep()

    def _forget_view(self, own_id: int | None) -> None:
        """Our session ended, so what we knew of others may be stale: every peer we
        knew is reported gone; the next join reports the live ones again."""
        old, self._view = self._view, {}
        for info in old.values():
            if info.id != own_id:
                self._emit(MemberLeft(info, "crashed"))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            # Bounded: a session that cannot run a heartbeat within half a ttl (a
            # statement stuck on it, a dead network) is not usable by anyone;
            # it is closed, and the member joins again.
            try:
                # The group comes with the beat when nothing else tells us of it
                # (not listening): one statement, and no pg_locks scan.
                wanted = not self.polling and not self._hears_news
                async with asyncio.timeout(self.ttl / 2):
                    state = await self._call(query("member_beat"), self.id, wanted)
            except TimeoutError:
                log.warning("member %r: no heartbeat within %.1fs; closing its session",
                            self.name, self.ttl / 2)
                if self._main is not None:
                    self._main.abort()
                self._lost.set()
                return
            except Exception as exc:
                self._survive(exc, "its heartbeat")
                continue
            if state is None:
                # Declared dead (our lock was not seen): a new incarnation joins.
                self._lost.set()
                return
            try:
                if self.polling:
                    await self._refresh()  # no NOTIFY behind a pooler: look
                else:
                    await self._listen_all()  # LISTEN only while something needs news
                    if not self._hears_news:
                        # No membership news: the ring, and the group for a later watch().
                        if wanted:
                            self._apply(json.loads(state), quiet=True)
                        else:
                            await self._refresh(quiet=True)
            except Exception as exc:
                self._survive(exc, "reading the group")

    def _survive(self, exc: Exception, what: str) -> None:
        """A statement on the main session failed, and the session may well live: a
        row or table lock held past the session's own 500 ms lock_timeout (an
        operator's transaction on pgcoord's tables, a migration), an operator's
        pg_cancel_backend. The member's life is its alive lock, not its heartbeat
        row: it stays, and tries again at its next beat. Re-raised (the member joins
        again) only for a session that is gone or a schema that is."""
        if _errmap.session_gone(exc) or _errmap.as_schema_missing(exc) is not exc:
            raise exc
        log.warning("member %r (id %s): %s failed (%r); trying again at the next beat",
                    self.name, self.id, what, exc)

    async def _news_loop(self) -> None:
        while True:
            await self._news.wait()
            self._news.clear()
            try:
                await self._refresh()
                await self._listen_all()  # a member no longer alone stops listening
            except Exception as exc:
                self._survive(exc, "reading the news")
                await asyncio.sleep(min(1.0, self.ttl / 3))
                self._news.set()  # not lost: read again

    def _on_notify(self, payload: str) -> None:
        try:
            news = json.loads(payload)
            member_id = int(news["id"])
        except (ValueError, KeyError, TypeError):
            return
        if news.get("ev") == "left":
            # A departure needs no query: apply it now, for the watcher too. Deaths
            # reaped together come in one NOTIFY ("ids": [[id, reason], ...]).
            together = news.get("ids") or [[member_id, news.get("reason")]]
            for gone_id, reason in together:
                self._forget(int(gone_id), str(reason or "crashed"), retarget=False)
            self._ring.retarget()  # once for them all
        else:
            self._news.set()

    def _forget(self, member_id: int, reason: str, *, retarget: bool = True) -> None:
        """Member ``member_id`` (of any group) is gone: tell who needs to know."""
        self._ring.drop(member_id)
        self._call_hooks(self._left_hooks, member_id)
        gone = self._view.pop(member_id, None)
        if gone is not None:
            self._emit(MemberLeft(gone, _as_reason(reason)))
        if retarget:
            self._ring.retarget()

    async def _read_ring(self) -> None:
        """The ring read afresh, for a member that does not listen to membership news:
        members gone from it are told to the left hooks, and the watcher moves on."""
        if not self._hears_news and not self.polling:
            for member_id in await self._ring.read():
                self._call_hooks(self._left_hooks, member_id)

    def stand(self, lease: str, poke: Callable[[], None]) -> Callable[[], None]:
        """Stand for ``lease`` on this member (a follower, a waiting ``Lease``):
        ``poke()`` is called at once when its holder lets it go or is found dead,
        without listening to anything (see ``member/ring.py``). Returns the
        withdrawal. Behind a pooler nothing pokes: the caller looks every ttl/3."""
        return self._ring.stand(lease, poke)

    def _needs_news(self) -> bool:
        """Membership news is listened to only while something on this member needs it
        (a ``watch()``, or a feature listening on another channel: Partitions): every
        listening session is signalled by every NOTIFY in the database. A member
        alone in the ring listens too: its watcher has nobody to wait for, and the
        news of the next member's join is how it learns whom to watch (at most one
        session in the database listens for that reason)."""
        return (bool(self._subscribers) or self._channels.wanted()
                or self._ring.successor() is None)

    async def listen(self, channel: str, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback(payload)`` for each NOTIFY on ``channel``, on the member's
        session, from now on and again after every rejoin (news sent while the
        session was away is lost: callers also look for themselves now and then).
        Behind a pooler nothing arrives. Returns a function that stops it."""
        remove = self._channels.add(channel, callback)

        def stop() -> None:
            if remove() and self._joined.is_set():
                self._spawn(self._listen_all(), f"pgcoord-member-unlisten:{self.name}")

        if self._joined.is_set():
            try:
                await self._listen_all()
            except BaseException:
                stop()
                raise
        return stop

    @property
    def _listening(self) -> set[str]:
        """The channels LISTENed to on the current session."""
        return self._channels.listening

    @property
    def _hears_news(self) -> bool:
        """Whether membership news reaches this member: through the process's
        listening session (``news_hub.py``), perhaps its own."""
        return self._hub.has(self)

    # What the process's news hub asks of its members (``news_hub.NewsReader``).

    def on_news(self, payload: str) -> None:
        self._on_notify(payload)

    def catch_up(self) -> None:
        self._news.set()

    def can_carry(self) -> bool:
        return self._main is not None and not self._lost.is_set() and not self.polling

    async def _listen_all(self) -> None:
        """LISTEN on every channel needed now and not yet listened to on this session,
        and UNLISTEN those no longer needed (again until nothing is left to do, for
        changes made meanwhile). Membership news that was not heard while nobody
        needed it is caught up on when it is needed again."""
        main = self._main
        if main is None or self.polling:
            return
        caught_up = False
        async with self._main_io:
            while main is self._main:
                if self._lost.is_set():
                    return  # the next session listens on what it needs when it joins
                try:
                    if self._needs_news():
                        caught_up = self._hub.register(self) or caught_up
                        base: str | None = CHANNEL if self._hub.carries(self) else None
                    else:
                        self._hub.unregister(self)
                        base = None
                    changed = await self._channels.step(main, base, self._hub.dispatch)
                except Exception as exc:
                    if not _errmap.session_gone(exc):
                        mapped = _errmap.as_schema_missing(exc)
                        if mapped is exc:
                            raise
                        raise mapped from exc
                    # The session is gone: the loop joins again, and the new session
                    # listens on every registered channel. Not the caller's error.
                    self._lost.set()
                    return
                if changed is None:
                    break
                if changed == CHANNEL and CHANNEL in self._listening:
                    caught_up = True
                    self._hub.listening(self)
        if caught_up and self.id is not None:
            # What changed while the LISTEN was being set up; during a join too, whose
            # first read came before a LISTEN that the join could not make first.
            await self._refresh()

    def _call_hooks(self, hooks: list[Callable[[int], None]], member_id: int) -> None:
        for hook in list(hooks):
            try:
                hook(member_id)
            except Exception:
                log.exception("member %r: a hook for member %d failed", self.name, member_id)

    def on_member_left(self, hook: Callable[[int], None]) -> Callable[[], None]:
        """Call ``hook(member_id)`` whenever any member of any group is known gone
        (for features tied to members: electors, leases, job claims). Returns a
        function that removes the hook."""
        return _add_hook(self._left_hooks, hook)

    def on_session_lost(self, hook: Callable[[int], None]) -> Callable[[], None]:
        """Call ``hook(old_id)`` at once when this member's own session ends (before
        it joins again under a new id): whatever was tied to it is gone. Returns a
        function that removes the hook."""
        return _add_hook(self._lost_hooks, hook)

    async def _refresh(self, *, initial: bool = False, quiet: bool = False) -> None:
        self._apply(json.loads(await self._call(query("member_state"), self.group)),
                    initial=initial, quiet=quiet)

    def _apply(self, state: dict[str, Any], *, initial: bool = False, quiet: bool = False) -> None:
        """What a read of the group found (``member_state``'s shape): the ring, the
        view, and (unless ``quiet``) the joins and departures it tells."""
        fresh = {info.id: info for info in map(_info, state["peers"])}
        ring = [int(i) for i in state["ring"]]
        gone: dict[str, str] = state["gone"]
        for member_id in set(self._ring.ids) - set(ring):
            self._call_hooks(self._left_hooks, member_id)
        self._ring.ids = ring
        old, self._view = self._view, fresh
        if quiet:
            self._ring.retarget()
            return
        if not initial or old:
            unrecorded = set(ring)
            for member_id, info in old.items():
                if member_id not in fresh and member_id in unrecorded:
                    # Its session has ended, but its row is not marked yet: told once it
                    # is, with the reason it records (the NOTIFY of whoever marks it, or
                    # a later read), not before with a guess. The ring (rows whose death
                    # is not recorded) still lists it, so a watcher reaps it at once.
                    self._view[member_id] = info
                elif member_id not in fresh:
                    # Gone without news reaching us (we poll, or our session was
                    # away): the tombstone says why, for a minute.
                    self._emit(MemberLeft(info, _as_reason(gone.get(str(member_id), "crashed"))))
        for member_id, info in fresh.items():
            if member_id not in old and member_id != self.id:
                self._emit(MemberJoined(info))
        self._ring.retarget()

    def _emit(self, change: MemberChange) -> None:
        for queue in self._subscribers:
            queue.put_nowait(change)

    # -- the public view -----------------------------------------------------------------------

    async def peers(self) -> list[MemberInfo]:
        """Every live member of the group, this one included, by id (a fresh read)."""
        if not self._open:
            raise RuntimeError("Member is not open: use `async with Member(...)`")
        await self._joined.wait()
        state = json.loads(await self._call(query("member_state"), self.group))
        return [_info(row) for row in state["peers"]]

    def watch(self) -> MemberWatch:
        """Membership changes from this call on: ``MemberJoined`` and ``MemberLeft``.

        Subscribes at once (not at the first ``__anext__``), so nothing that
        happens between this call and the first read is missed. Ends when the
        member is closed. A lost session of our own is reported as every peer
        leaving (``crashed``), then joining again once we have rejoined.
        """
        subscription: Subscription[MemberChange] = Subscription(self._subscribers)
        if self._joined.is_set() and not self._hears_news:
            self._spawn(self._start_news(), f"pgcoord-member-listen:{self.name}")
        return subscription

    async def _start_news(self) -> None:
        """Start listening to membership news for a new ``watch()``: the view is
        brought up to date first without telling anyone (what changed before the
        call is not news to it), then, once the LISTEN is in place, read again and
        what changed in between is told."""
        with contextlib.suppress(SessionLost):
            await self._refresh(quiet=True)
            await self._listen_all()


#: An async iterator of membership changes; see ``Member.watch``.
MemberWatch = Subscription[MemberChange]
