"""``manage.py pgcoord_scheduler``: run the project's pgcoord jobs on this replica.

Every replica may run it: each slot of each job runs once across all of them. Jobs are
plain functions using the ORM; they run in a worker thread (``sync_to_async``), where
Django manages their database connection as in a request.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from django.core.management.base import BaseCommand
from django.db import close_old_connections, connection, connections
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

import pgcoord


def record_heartbeat(slot_key: str) -> None:
    """An ORM-side job (here raw SQL, to need no model migrations in the recipe)."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO recipe_heartbeats (slot) VALUES (%s)", [slot_key])
    finally:
        # As at the end of a request: the worker thread keeps no connection open.
        close_old_connections()


def conninfo(alias: str = "default") -> str:
    settings = connections[alias].settings_dict
    return make_conninfo(dbname=settings["NAME"], user=settings.get("USER") or None,
                         password=settings.get("PASSWORD") or None, host=settings.get("HOST") or None,
                         port=str(settings["PORT"]) if settings.get("PORT") else None)


class Command(BaseCommand):
    help = "Run the pgcoord scheduler (run-once cron across replicas) until stopped."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--seconds", type=float, default=None, help="stop after this long (tests)")

    def handle(self, *args: Any, seconds: float | None = None, **options: Any) -> None:
        asyncio.run(self.serve(seconds))

    async def serve(self, seconds: float | None) -> None:
        async with AsyncConnectionPool(conninfo(), min_size=1, max_size=4, open=False) as pool:
            sched = pgcoord.Scheduler(pool)

            @sched.cron("recipes:django-heartbeat", "* * * * * *")
            async def heartbeat(slot: pgcoord.Slot) -> None:
                await sync_to_async(record_heartbeat)(slot.key)

            runner = asyncio.create_task(sched.run())
            try:
                if seconds is None:
                    await runner
                else:
                    await asyncio.sleep(seconds)
            finally:
                await sched.stop()
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)
