-- Runtime SQL, one named block per statement: `-- name: <name>` then the text.
-- Names are grouped by what they touch. {fn} is one of pgcoord's fixed advisory
-- function names and {key}/{timeout_ms} are integers validated in Python: they
-- are inlined so that a lock is one simple-protocol statement with no parse step.
-- $1, $2 are bind parameters, rewritten per driver.

-- name: advisory_wait
SELECT pg_catalog.{fn}({key})

-- name: advisory_wait_bound
-- The same with the key bound, for drivers that prepare repeated statements
-- (psycopg, SQLAlchemy): one plan serves every key.
SELECT pg_catalog.{fn}($1)

-- name: advisory_try
-- The try form raises instead of returning false so that it can share a round
-- trip with BEGIN in one simple-protocol message.
DO $pgcoord$ BEGIN
    IF NOT pg_catalog.{fn}({key}) THEN
        RAISE EXCEPTION 'pgcoord: advisory lock is held by another session' USING ERRCODE = 'PC001';
    END IF;
END $pgcoord$

-- name: advisory_timeout
-- lock_timeout applies to this one statement only: it is restored afterwards so
-- the body's own statements keep the session's setting. On error the enclosing
-- transaction or savepoint rollback discards it.
DO $pgcoord$
DECLARE previous text := pg_catalog.current_setting('lock_timeout');
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '{timeout_ms}ms', true);
    PERFORM pg_catalog.{fn}({key});
    PERFORM pg_catalog.set_config('lock_timeout', previous, true);
END $pgcoord$

-- name: savepoint_begin
SAVEPOINT pgcoord_lock

-- name: savepoint_release
RELEASE SAVEPOINT pgcoord_lock

-- name: savepoint_rollback
ROLLBACK TO SAVEPOINT pgcoord_lock

-- name: lock_names_record
INSERT INTO pgcoord.lock_names (key, name) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING

-- name: advisory_held_by_me
SELECT count(*) FROM pg_catalog.pg_locks
WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid() AND granted

-- name: holders_list
SELECT kind, name, key, holder, pid, application_name, client_addr::text AS client_addr,
       granted, since, expires_at, fence, blocked_by,
       extract(epoch FROM pg_catalog.now() - since)::float8 AS age_seconds,
       extract(epoch FROM expires_at - pg_catalog.now())::float8 AS expires_in_seconds
FROM pgcoord.holders
ORDER BY kind, coalesce(name, key::text), granted DESC, since
