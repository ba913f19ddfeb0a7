"""The recipes in examples/recipes run, each against a real server, and do what
docs/recipes.md says they do."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest

from .conftest import sql


def poll(check: Callable[[], Any], within: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.02)


def test_fastapi_lifespan_probes_and_leader(pgcoord_dsn: str) -> None:
    from fastapi.testclient import TestClient

    from examples.recipes.fastapi_app import create_app

    app = create_app(pgcoord_dsn, ttl=3.0)
    with TestClient(app) as client:
        assert client.get("/livez").status_code == 200
        first = poll(lambda: (r := client.get("/leader").json())["me"] and r, what="this replica leads")
        assert first["leader"] and first["fence"] >= 1
        assert client.get("/readyz").status_code == 200
        poll(lambda: app.state.ticks >= 1, within=6, what="the scheduled job ran")
        # Leadership is taken away while the member stays connected, and the duty's
        # cleanup takes 1.5 s: not ready meanwhile (elector.healthy), though the member
        # has its session; ready again as a follower; leads again once given back.
        import asyncio

        from pgcoord import testing

        app.state.cleanup_seconds = 1.5
        outsider = asyncio.run(testing.take_leadership(pgcoord_dsn, "recipes:fanout-owner"))
        assert outsider > first["fence"]
        poll(lambda: client.get("/readyz").status_code == 503, within=5, what="not ready")
        assert app.state.member.has_session
        assert client.get("/livez").status_code == 200  # alive all along
        poll(lambda: client.get("/readyz").status_code == 200, within=10, what="ready again")
        assert client.get("/leader").json()["leader"] == testing.OUTSIDER
        asyncio.run(testing.release_leadership(pgcoord_dsn, "recipes:fanout-owner"))
        again = poll(lambda: (r := client.get("/leader").json())["me"] and r, what="leads again")
        assert again["fence"] > outsider
    # The lifespan's exit stopped everything: no member left, no lease held.
    assert sql(pgcoord_dsn, "select count(*) from pgcoord.members") == [(0,)]
    assert sql(pgcoord_dsn, "select holder from pgcoord.leases where name = 'recipes:fanout-owner'") == [(None,)]


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


async def test_celery_beat_replacement_enqueues_once_per_slot(pgcoord_dsn: str) -> None:
    import asyncio

    import asyncpg

    from examples.recipes.celery_beat import celery_app, make_scheduler

    pools = [await asyncpg.create_pool(pgcoord_dsn, min_size=1, max_size=3) for _ in range(3)]
    scheds = [make_scheduler(pool, expr="* * * * * *") for pool in pools]  # every second, 3 replicas
    runs = [asyncio.create_task(s.run()) for s in scheds]
    try:
        await asyncio.sleep(6.5)  # at least 3 slots even when the replicas start late (CI, loaded)
    finally:
        for s in scheds:
            await s.stop()
        for r in runs:
            r.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await r
        for pool in pools:
            await pool.close()
    keys: list[str] = []
    with celery_app.connection_for_read() as conn:
        queue = conn.SimpleQueue("celery")
        while True:
            try:
                message = queue.get(block=False)
            except queue.Empty:
                break
            keys.append(message.headers["id"])
            message.ack()
        queue.close()
    rows = sql(pgcoord_dsn, "select job || '@' || to_char(slot_at at time zone 'UTC',"
                            " 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), state from pgcoord.job_slots"
                            " where job = 'recipes:send-digest'")
    succeeded = sorted(str(k) for k, state in rows if state == "succeeded")
    assert len(succeeded) >= 3
    assert len(keys) == len(set(keys)), "a slot was enqueued twice"
    assert sorted(keys) == succeeded


@pytest.fixture
def django_db(pgcoord_dsn: str) -> str:
    """Django configured (once per process) on this test's database."""
    from urllib.parse import urlsplit

    import django
    from django.conf import settings
    from django.db import connections

    url = urlsplit(pgcoord_dsn)
    database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"),
                "USER": url.username or "postgres", "PASSWORD": url.password or "",
                "HOST": url.hostname, "PORT": str(url.port), "CONN_MAX_AGE": 0}
    if not settings.configured:
        settings.configure(DATABASES={"default": database}, INSTALLED_APPS=["examples.recipes.django_app"],
                           USE_TZ=True)
        django.setup()
    else:
        connections["default"].close()
        settings.DATABASES["default"].update(database)
        connections["default"].settings_dict.update(database)
    return pgcoord_dsn


def test_django_exclusive_is_atomic_with_the_orm_writes(django_db: str) -> None:
    import threading

    from django.db import connection

    from examples.recipes.django_app.locks import exclusive

    sql(django_db, "create table recipe_counter (id int primary key, n int not null)")
    sql(django_db, "insert into recipe_counter values (1, 0)")
    errors: list[BaseException] = []

    def bump() -> None:
        try:
            for _ in range(5):
                with exclusive("recipes:counter"):
                    with connection.cursor() as cursor:
                        cursor.execute("select n from recipe_counter where id = 1")
                        (n,) = cursor.fetchone()
                        time.sleep(0.01)  # a read-modify-write that would lose updates unlocked
                        cursor.execute("update recipe_counter set n = %s where id = 1", [n + 1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sql(django_db, "select n from recipe_counter") == [(20,)]
    # A failing body rolls back its writes with the lock, and leaves no lock behind.
    with pytest.raises(ZeroDivisionError):
        with exclusive("recipes:counter"):
            with connection.cursor() as cursor:
                cursor.execute("update recipe_counter set n = 0 where id = 1")
            1 / 0  # noqa: B018
    connection.close()
    assert sql(django_db, "select n from recipe_counter") == [(20,)]
    assert sql(django_db, "select count(*) from pg_locks where locktype = 'advisory'") == [(0,)]


def test_django_management_command_runs_each_slot_once(django_db: str) -> None:
    import threading

    from django.core.management import call_command

    sql(django_db, "create table recipe_heartbeats (slot text not null)")
    # Two replicas of the command at once.
    threads = [threading.Thread(target=call_command, args=("pgcoord_scheduler", "--seconds", "3.5"))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    slots = [s for (s,) in sql(django_db, "select slot from recipe_heartbeats")]  # type: ignore[misc]
    states = sql(django_db, "select state, count(*) from pgcoord.job_slots"
                            " where job = 'recipes:django-heartbeat' group by state")
    assert len(slots) >= 2 and len(slots) == len(set(slots)), slots
    assert dict(states).get("succeeded") == len(slots)  # type: ignore[arg-type]
