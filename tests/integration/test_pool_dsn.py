"""The DSN of a pool's own connection parameters (a ``Scheduler(pool)``'s private
member connects with it): it must reach where the pool reaches, whatever mix of DSN
and keyword arguments built the pool."""

from __future__ import annotations

import asyncpg
from psycopg.conninfo import conninfo_to_dict

from pgcoord._drivers.pool_dsn import pool_dsn


async def where(dsn: str) -> tuple[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow("select current_database(), current_user")
        assert row is not None
        return str(row[0]), str(row[1])
    finally:
        await conn.close()


async def test_keyword_arguments_win_over_the_dsn_as_they_do_for_the_pool(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    real_db = str(params["dbname"])
    wrong = f"postgresql://nobody:wrong@127.0.0.1:1/not_{real_db}"
    pool = await asyncpg.create_pool(wrong, min_size=1, max_size=1, database=real_db,
                                     host="127.0.0.1", port=int(params["port"]),
                                     user=str(params.get("user", "postgres")), password="")
    try:
        async with pool.acquire() as conn:
            expected = (await conn.fetchval("select current_database()"),
                        await conn.fetchval("select current_user"))
        own, driver = pool_dsn(pool)
        assert driver == "asyncpg"
        assert await where(own) == expected == (real_db, str(params.get("user", "postgres")))
    finally:
        await pool.close()


async def test_a_database_given_as_a_keyword_beside_a_url(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    real_db = str(params["dbname"])
    url = f"postgresql://{params.get('user', 'postgres')}@127.0.0.1:{params['port']}/postgres"
    pool = await asyncpg.create_pool(url, min_size=1, max_size=1, database=real_db)
    try:
        own, _driver = pool_dsn(pool)
        assert (await where(own))[0] == real_db
    finally:
        await pool.close()
