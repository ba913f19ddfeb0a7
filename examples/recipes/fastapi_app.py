"""FastAPI: one Member per process, a leader-elected background duty, a Scheduler,
and Kubernetes probes, all started and stopped by the app's lifespan.

    PGCOORD_DSN=postgresql://user@host/db uvicorn examples.recipes.fastapi_app:app

Probes (see docs/recipes.md for the Kubernetes side):
- GET /livez   200 while the process serves requests. Never tied to the database: a
               database outage must not get every replica restarted at once.
- GET /readyz  503 while this replica's member has no session, or while a leader duty
               it was told to stop is still running (``elector.healthy``): its trust
               window has closed, so it must not look ready; 200 otherwise.
- GET /leader  who leads the duty, and this replica's fence when it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
from fastapi import FastAPI, Response

import pgcoord

DUTY = "recipes:fanout-owner"


def create_app(dsn: str, *, ttl: float = 10.0) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
        member = pgcoord.Member(dsn, group="web", ttl=ttl)
        await member.open()
        elector = pgcoord.Elector(member, DUTY, ttl=ttl)
        sched = pgcoord.Scheduler(pool, member=member)
        app.state.member, app.state.elector, app.state.sched = member, elector, sched
        app.state.ticks = 0

        @sched.cron("recipes:cache-refresh", "*/2 * * * * *")  # every 2 s, once across replicas
        async def refresh(slot: pgcoord.Slot) -> None:
            app.state.ticks += 1

        async def lead(fence: int) -> None:
            # The duty only one replica may do: the websocket fan-out, a queue reader...
            try:
                while True:
                    await asyncio.sleep(0.5)
            finally:
                await asyncio.sleep(app.state.cleanup_seconds)  # flushing what it owes

        app.state.cleanup_seconds = 0.0
        tasks = [asyncio.create_task(elector.run(lead)), asyncio.create_task(sched.run())]
        try:
            yield
        finally:
            await elector.stop()
            await sched.stop()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await member.close()
            await pool.close()

    app = FastAPI(lifespan=lifespan)

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz(response: Response) -> dict[str, Any]:
        member: pgcoord.Member = app.state.member
        elector: pgcoord.Elector = app.state.elector
        ready = member.has_session and elector.healthy
        if not ready:
            response.status_code = 503
        return {"ready": ready, "member": member.id, "leading": elector.is_leader}

    @app.get("/leader")
    async def leader() -> dict[str, Any]:
        elector: pgcoord.Elector = app.state.elector
        return {"leader": await elector.leader(), "me": elector.is_leader, "fence": elector.fence}

    return app


if "PGCOORD_DSN" in os.environ:
    app = create_app(os.environ["PGCOORD_DSN"])
