-- Runtime SQL of pgcoord.Partitions, in the format of queries.sql. Each part
-- "<name>/<index>" is an ordinary row of pgcoord.leases, so its fence is a lease
-- fence and check_fence() works on it. An owner holds the part's doorbell
-- (pgcoord.lease_doorbell_key, as an elector's leader does) on its member's
-- session, so the row is free for the taking the moment that session ends.
-- Every statement here runs on a member's shared session: none may wait for a
-- row lock (rows held FOR SHARE by a fenced write are skipped, not waited for).

-- name: partition_join
-- Take part in partitions $1 ($2 parts) as member $3: make sure every part's
-- row exists (fence 0, no holder), hold the participation lock that says so
-- while this session lives, name it for pgcoord.holders (forgotten with the
-- member's row: migration 0009), and tell the other participants.
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer) AS count, CAST($3 AS integer) AS member_id),
named AS (
    INSERT INTO pgcoord.lock_names (key, name)
    SELECT pgcoord.lock_key(x.lname), x.lname
    FROM (SELECT 'pgcoord.partitions:' || p.name || ':' || p.member_id AS lname FROM p) AS x
    ON CONFLICT (key) DO NOTHING
),
made AS (
    INSERT INTO pgcoord.leases (name, holder, fence)
    SELECT p.name || '/' || g.i, NULL, 0 FROM p, pg_catalog.generate_series(0, p.count - 1) AS g(i)
    ON CONFLICT (name) DO NOTHING
    RETURNING 1
),
joined AS (
    SELECT pg_catalog.pg_try_advisory_lock(pgcoord.lock_key('pgcoord.partitions:' || p.name || ':' || p.member_id)) AS ok,
           (SELECT pg_catalog.count(*) FROM made) AS made
    FROM p
),
told AS (SELECT pg_catalog.pg_notify('pgcoord_partitions', p.name) FROM p, joined)
SELECT joined.ok FROM joined, told

-- name: partition_leave
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer) AS member_id),
left_ AS (
    SELECT pg_catalog.pg_advisory_unlock(pgcoord.lock_key('pgcoord.partitions:' || p.name || ':' || p.member_id)) AS ok
    FROM p
),
told AS (SELECT pg_catalog.pg_notify('pgcoord_partitions', p.name) FROM p, left_)
SELECT left_.ok FROM left_, told

-- name: partition_state
-- The participants of partitions $1 (live members whose session holds the
-- participation lock), as "<name>/<id>", and the current holder and fence of each of its $2
-- parts whose lease has not expired; as JSON so that every driver returns the
-- same shape.
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer) AS count),
held AS MATERIALIZED (
    SELECT l.pid, (l.classid::bigint << 32) | l.objid::bigint AS key
    FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                        WHERE d.datname = pg_catalog.current_database())
)
SELECT pg_catalog.json_build_object(
    'members', (SELECT coalesce(pg_catalog.json_agg(m.name || '/' || m.id ORDER BY m.id), '[]'::json)
                FROM pgcoord.member_sessions AS m, p
                WHERE m.left_at IS NULL
                  AND EXISTS (SELECT 1 FROM held AS h WHERE h.pid = m.pid
                              AND h.key = pgcoord.lock_key('pgcoord.partitions:' || p.name || ':' || m.id))),
    'owners', (SELECT coalesce(pg_catalog.json_agg(pg_catalog.json_build_array(g.i, c.holder, c.fence)), '[]'::json)
               FROM p CROSS JOIN pg_catalog.generate_series(0, p.count - 1) AS g(i)
               JOIN pgcoord.leases AS c ON c.name = p.name || '/' || g.i
               WHERE c.holder IS NOT NULL AND c.expires_at > pg_catalog.clock_timestamp()),
    -- The part numbered count itself owned: a member runs this with a larger count.
    'beyond', (SELECT EXISTS (SELECT 1 FROM pgcoord.leases AS c, p
                              WHERE c.name = p.name || '/' || p.count AND c.holder IS NOT NULL
                                AND c.expires_at > pg_catalog.clock_timestamp()))
)::text

-- name: partition_claim
-- Take parts $2 of partitions $1 for holder $3 with a ttl of $4 ms: each one
-- whose doorbell this session gets and whose row is free, expired, or held by
-- a session that no longer holds the doorbell (gone). Doorbells of parts not
-- taken are given back in the same statement. Returns [[index, fence], ...].
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer[]) AS idx, CAST($3 AS text) AS holder,
                  CAST($4 AS bigint) AS ttl_ms),
rung AS MATERIALIZED (
    SELECT w.i, w.lname
    FROM (SELECT i, p.name || '/' || i AS lname FROM p, pg_catalog.unnest(p.idx) AS i) AS w
    WHERE pg_catalog.pg_try_advisory_lock(pgcoord.lease_doorbell_key(w.lname))
),
free AS MATERIALIZED (
    SELECT c.name FROM pgcoord.leases AS c
    WHERE c.name IN (SELECT lname FROM rung)
      AND (c.holder IS NULL OR c.expires_at <= pg_catalog.clock_timestamp()
           OR (c.holder_pid IS NOT NULL AND NOT pgcoord.lease_session_alive(c.name, c.holder_pid, c.holder_server)))
    FOR NO KEY UPDATE OF c SKIP LOCKED
),
taken AS (
    UPDATE pgcoord.leases AS l
       SET holder = p.holder, fence = l.fence + 1, holder_pid = pg_catalog.pg_backend_pid(),
           acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
           expires_at = pg_catalog.clock_timestamp() + p.ttl_ms * interval '1 millisecond'
      FROM free, p
     WHERE l.name = free.name
    RETURNING l.name, l.fence
),
unrung AS (
    SELECT pg_catalog.pg_advisory_unlock(pgcoord.lease_doorbell_key(r.lname)) AS ok
    FROM rung AS r WHERE NOT EXISTS (SELECT 1 FROM taken AS t WHERE t.name = r.lname)
)
SELECT pg_catalog.json_build_array(
    (SELECT coalesce(pg_catalog.json_agg(pg_catalog.json_build_array(r.i, t.fence)), '[]'::json)
     FROM taken AS t JOIN rung AS r ON r.lname = t.name),
    (SELECT pg_catalog.count(*) FROM unrung)
)::text

-- name: partition_renew
-- Extend parts $2 (with fences $3) of partitions $1 held by $4, by $5 ms.
-- Returns [renewed indexes, indexes still ours]: a part still ours but not
-- renewed is held FOR SHARE by a fenced transaction right now (tried again
-- next time); a part not in the second list is lost.
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer[]) AS idx, CAST($3 AS bigint[]) AS fences,
                  CAST($4 AS text) AS holder, CAST($5 AS bigint) AS ttl_ms),
mine AS MATERIALIZED (
    SELECT o.i, p.name || '/' || o.i AS lname, o.f FROM p, ROWS FROM (pg_catalog.unnest(p.idx), pg_catalog.unnest(p.fences)) AS o(i, f)
),
ours AS MATERIALIZED (
    SELECT m.i, m.lname FROM mine AS m JOIN pgcoord.leases AS c ON c.name = m.lname AND c.fence = m.f, p
    WHERE c.holder = p.holder AND c.expires_at > pg_catalog.clock_timestamp()
),
free AS MATERIALIZED (
    SELECT c.name FROM pgcoord.leases AS c WHERE c.name IN (SELECT lname FROM ours)
    FOR NO KEY UPDATE OF c SKIP LOCKED
),
renewed AS (
    UPDATE pgcoord.leases AS l
       SET renewed_at = pg_catalog.clock_timestamp(),
           expires_at = pg_catalog.clock_timestamp() + p.ttl_ms * interval '1 millisecond'
      FROM free, p
     WHERE l.name = free.name
    RETURNING l.name
)
SELECT pg_catalog.json_build_array(
    (SELECT coalesce(pg_catalog.json_agg(o.i), '[]'::json) FROM ours AS o JOIN renewed AS r ON r.name = o.lname),
    (SELECT coalesce(pg_catalog.json_agg(o.i), '[]'::json) FROM ours AS o)
)::text

-- name: partition_renew_waiting
-- partition_renew for parts that were held FOR SHARE (a fenced write in flight):
-- this one waits for such a transaction, at most $1 ms (the shared session must
-- not stall), and returns the same [renewed, still ours] pair.
WITH cfg AS MATERIALIZED (SELECT pg_catalog.set_config('lock_timeout', CAST($1 AS text), true) AS v),
p AS (SELECT CAST($2 AS text) AS name, CAST($3 AS integer[]) AS idx, CAST($4 AS bigint[]) AS fences,
             CAST($5 AS text) AS holder, CAST($6 AS bigint) AS ttl_ms),
mine AS MATERIALIZED (
    SELECT o.i, p.name || '/' || o.i AS lname, o.f FROM p, ROWS FROM (pg_catalog.unnest(p.idx), pg_catalog.unnest(p.fences)) AS o(i, f)
),
ours AS MATERIALIZED (
    SELECT m.i, m.lname FROM mine AS m JOIN pgcoord.leases AS c ON c.name = m.lname AND c.fence = m.f, p
    WHERE c.holder = p.holder AND c.expires_at > pg_catalog.clock_timestamp()
),
locked AS MATERIALIZED (
    SELECT c.name FROM pgcoord.leases AS c, cfg WHERE c.name IN (SELECT lname FROM ours)
    FOR NO KEY UPDATE OF c
),
renewed AS (
    UPDATE pgcoord.leases AS l
       SET renewed_at = pg_catalog.clock_timestamp(),
           expires_at = pg_catalog.clock_timestamp() + p.ttl_ms * interval '1 millisecond'
      FROM locked, p
     WHERE l.name = locked.name AND l.expires_at > pg_catalog.clock_timestamp()
    RETURNING l.name
)
SELECT pg_catalog.json_build_array(
    (SELECT coalesce(pg_catalog.json_agg(o.i), '[]'::json) FROM ours AS o JOIN renewed AS r ON r.name = o.lname),
    (SELECT coalesce(pg_catalog.json_agg(o.i), '[]'::json) FROM ours AS o)
)::text

-- name: partition_release
-- Give up parts $2 (with fences $3) of partitions $1 held by $4, and their
-- doorbells $5 (the parts whose doorbell this session holds). A row held FOR
-- SHARE right now is skipped: with its doorbell given back it is free for the
-- taking all the same. Returns [rows released, doorbells given back].
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer[]) AS idx, CAST($3 AS bigint[]) AS fences,
                  CAST($4 AS text) AS holder, CAST($5 AS integer[]) AS rung),
mine AS MATERIALIZED (
    SELECT p.name || '/' || o.i AS lname, o.f FROM p, ROWS FROM (pg_catalog.unnest(p.idx), pg_catalog.unnest(p.fences)) AS o(i, f)
),
free AS MATERIALIZED (
    SELECT c.name FROM pgcoord.leases AS c JOIN mine AS m ON c.name = m.lname AND c.fence = m.f, p
    WHERE c.holder = p.holder
    FOR NO KEY UPDATE OF c SKIP LOCKED
),
released AS (
    UPDATE pgcoord.leases AS l SET holder = NULL, holder_pid = NULL, expires_at = pg_catalog.clock_timestamp()
      FROM free WHERE l.name = free.name
    RETURNING 1
),
unrung AS (
    SELECT pg_catalog.pg_advisory_unlock(pgcoord.lease_doorbell_key(p.name || '/' || r.i)) AS ok
    FROM p, pg_catalog.unnest(p.rung) AS r(i)
)
SELECT pg_catalog.json_build_array((SELECT pg_catalog.count(*) FROM released), (SELECT pg_catalog.count(*) FROM unrung))::text

-- name: partition_unring
-- After a claim that failed midway: give back the doorbells of parts $2 of
-- partitions $1 that this session holds (session locks outlive the failed
-- statement's transaction).
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer[]) AS idx)
SELECT pg_catalog.count(pg_catalog.pg_advisory_unlock(pgcoord.lease_doorbell_key(p.name || '/' || i)))::integer
FROM p, pg_catalog.unnest(p.idx) AS i
WHERE EXISTS (
    SELECT 1 FROM pg_catalog.pg_locks AS l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid = pg_catalog.pg_backend_pid()
      AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lease_doorbell_key(p.name || '/' || i)
)

-- name: partition_release_all
-- Give up every part of partitions $1 ($2 parts) held by $3, and every one of
-- their doorbells this session holds (also those of a claim whose reply was
-- never read). Returns [rows released, doorbells given back].
WITH p AS (SELECT CAST($1 AS text) AS name, CAST($2 AS integer) AS count, CAST($3 AS text) AS holder),
parts AS MATERIALIZED (
    SELECT p.name || '/' || g.i AS lname FROM p, pg_catalog.generate_series(0, p.count - 1) AS g(i)
),
free AS MATERIALIZED (
    SELECT c.name FROM pgcoord.leases AS c, p
    WHERE c.name IN (SELECT lname FROM parts) AND c.holder = p.holder
    FOR NO KEY UPDATE OF c SKIP LOCKED
),
released AS (
    UPDATE pgcoord.leases AS l SET holder = NULL, holder_pid = NULL, expires_at = pg_catalog.clock_timestamp()
      FROM free WHERE l.name = free.name
    RETURNING 1
),
mine AS MATERIALIZED (
    SELECT h.key FROM pg_catalog.pg_locks AS l
    CROSS JOIN LATERAL (SELECT (l.classid::bigint << 32) | l.objid::bigint AS key) AS h
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid = pg_catalog.pg_backend_pid()
),
unrung AS (
    SELECT pg_catalog.pg_advisory_unlock(b.key) AS ok
    FROM (SELECT pgcoord.lease_doorbell_key(lname) AS key FROM parts) AS b
    WHERE b.key IN (SELECT key FROM mine)
)
SELECT pg_catalog.json_build_array((SELECT pg_catalog.count(*) FROM released), (SELECT pg_catalog.count(*) FROM unrung))::text
