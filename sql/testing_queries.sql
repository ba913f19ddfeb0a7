-- Runtime SQL of pgcoord.testing (failures on demand), in the format of queries.sql.

-- name: testing_take_lease
-- An outsider takes lease $1 as holder $2 for $3 ms, whoever holds it: a new
-- fence, no session bound to it (holder_pid NULL, so only its expiry or
-- testing_release_lease frees it).
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS text) AS holder, CAST($3 AS bigint) AS ttl_ms)
INSERT INTO pgcoord.leases AS l (name, holder, fence, acquired_at, renewed_at, expires_at, holder_pid)
SELECT p.name, p.holder, 1, pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(),
       pg_catalog.clock_timestamp() + p.ttl_ms * interval '1 millisecond', NULL
FROM p
ON CONFLICT (name) DO UPDATE
    SET holder = excluded.holder, fence = l.fence + 1, acquired_at = excluded.acquired_at,
        renewed_at = excluded.renewed_at, expires_at = excluded.expires_at, holder_pid = NULL
RETURNING l.fence

-- name: testing_release_lease
WITH released AS (
    UPDATE pgcoord.leases AS l
       SET holder = NULL, holder_pid = NULL, expires_at = pg_catalog.clock_timestamp()
     WHERE l.name = $1 AND l.holder = $2
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM released)

-- name: testing_terminate
SELECT pg_catalog.pg_terminate_backend($1)
