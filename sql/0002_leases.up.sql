-- pgcoord 0002: leases with fencing tokens, check_fence(), lease rows in the view.
-- Executed verbatim by migrations/versions/0002_leases.py.

-- One row per lease name, never deleted, so a fence never goes backwards. An
-- ordinary logged table: a crash must not reset fences. Only the database clock
-- (clock_timestamp) decides expiry.
CREATE TABLE pgcoord.leases (
    name        text PRIMARY KEY,
    holder      text,                 -- NULL once released
    fence       bigint NOT NULL,      -- +1 on every change of holder
    acquired_at timestamptz,
    renewed_at  timestamptz,
    expires_at  timestamptz,
    -- Elector leases only: the holder's backend pid. While that session holds the
    -- lease's doorbell lock it is alive; once it does not, others may take over.
    holder_pid  integer
);

COMMENT ON TABLE pgcoord.leases IS
    'pgcoord leases: one row per name, never deleted; fence increases on every change of holder.';

-- The session lock an elector's leader holds while it leads ("the doorbell").
CREATE FUNCTION pgcoord.lease_doorbell_key(lease_name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN pgcoord.lock_key('pgcoord.elector:' || lease_name);

-- True while the session that took an elector lease still holds its doorbell.
CREATE FUNCTION pgcoord.lease_session_alive(lease_name text, pid integer) RETURNS boolean
    LANGUAGE sql STABLE
    RETURN pid IS NOT NULL AND EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.pid = lease_session_alive.pid
          AND l.objsubid = 1
          AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lease_doorbell_key(lease_name)
    );

-- Take the lease when it is free, expired, or its elector session is gone.
-- Returns the new fence and expiry, or no row when someone else holds it.
-- A takeover's UPDATE waits for transactions that hold the row FOR SHARE
-- (check_fence), so a fenced write never interleaves with a takeover.
CREATE FUNCTION pgcoord.lease_acquire(
    lease_name text, new_holder text, ttl_ms bigint, session_pid integer
) RETURNS TABLE (fence bigint, expires_at timestamptz)
    LANGUAGE sql
    AS $body$
        INSERT INTO pgcoord.leases AS l
            (name, holder, fence, acquired_at, renewed_at, expires_at, holder_pid)
        VALUES (lease_name, new_holder, 1, pg_catalog.clock_timestamp(), pg_catalog.clock_timestamp(),
                pg_catalog.clock_timestamp() + ttl_ms * interval '1 millisecond', session_pid)
        ON CONFLICT (name) DO UPDATE
            SET holder = excluded.holder, fence = l.fence + 1,
                acquired_at = pg_catalog.clock_timestamp(), renewed_at = pg_catalog.clock_timestamp(),
                expires_at = pg_catalog.clock_timestamp() + ttl_ms * interval '1 millisecond',
                holder_pid = excluded.holder_pid
            WHERE l.holder IS NULL
               OR l.expires_at <= pg_catalog.clock_timestamp()
               OR (l.holder_pid IS NOT NULL
                   AND NOT pgcoord.lease_session_alive(l.name, l.holder_pid))
        RETURNING l.fence, l.expires_at
    $body$;

-- Extend a lease still held by exactly this holder and fence and not yet
-- expired. An expired lease is never renewed, not even by its last holder.
CREATE FUNCTION pgcoord.lease_renew(
    lease_name text, lease_holder text, lease_fence bigint, ttl_ms bigint
) RETURNS TABLE (expires_at timestamptz)
    LANGUAGE sql
    AS $body$
        UPDATE pgcoord.leases AS l
           SET renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + ttl_ms * interval '1 millisecond'
         WHERE l.name = lease_name AND l.holder = lease_holder AND l.fence = lease_fence
           AND l.expires_at > pg_catalog.clock_timestamp()
        RETURNING l.expires_at
    $body$;

-- Give the lease up; only its exact holder and fence can. The row stays.
CREATE FUNCTION pgcoord.lease_release(
    lease_name text, lease_holder text, lease_fence bigint
) RETURNS TABLE (fence bigint)
    LANGUAGE sql
    AS $body$
        UPDATE pgcoord.leases AS l
           SET holder = NULL, holder_pid = NULL, expires_at = pg_catalog.clock_timestamp()
         WHERE l.name = lease_name AND l.holder = lease_holder AND l.fence = lease_fence
        RETURNING l.fence
    $body$;

-- Raise SQLSTATE PC002 unless fence is the current, unexpired fence of the
-- lease. Locks the row FOR SHARE (not FOR KEY SHARE, which would not block a
-- takeover's UPDATE) until the caller's transaction ends.
CREATE FUNCTION pgcoord.check_fence(lease_name text, lease_fence bigint) RETURNS void
    LANGUAGE plpgsql
    AS $body$
DECLARE
    current_row pgcoord.leases;
BEGIN
    SELECT * INTO current_row FROM pgcoord.leases AS l WHERE l.name = lease_name FOR SHARE;
    -- Messages are built with || rather than RAISE format strings: percent
    -- signs would be taken for placeholders by some drivers running this file.
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PC002',
            MESSAGE = 'pgcoord: no lease named ' || quote_literal(lease_name),
            HINT = 'the fence was never issued';
    ELSIF current_row.fence <> lease_fence THEN
        RAISE EXCEPTION USING ERRCODE = 'PC002',
            MESSAGE = 'pgcoord: stale fence ' || lease_fence || ' for lease '
                      || quote_literal(lease_name) || ' (current fence ' || current_row.fence || ')';
    ELSIF current_row.holder IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PC002',
            MESSAGE = 'pgcoord: lease ' || quote_literal(lease_name) || ' with fence '
                      || lease_fence || ' was released';
    ELSIF current_row.expires_at <= pg_catalog.clock_timestamp() THEN
        RAISE EXCEPTION USING ERRCODE = 'PC002',
            MESSAGE = 'pgcoord: lease ' || quote_literal(lease_name) || ' with fence '
                      || lease_fence || ' has expired';
    END IF;
END
$body$;

COMMENT ON FUNCTION pgcoord.check_fence(text, bigint) IS
    'Raise SQLSTATE PC002 unless the fence is current; holds the lease row FOR SHARE until commit.';

-- The view gains a row per lease and a session_alive column at the end.
CREATE OR REPLACE VIEW pgcoord.holders AS
SELECT
    'advisory'::text                                   AS kind,
    n.name                                             AS name,
    k.key                                              AS key,
    coalesce(nullif(a.application_name, ''), 'pid ' || l.pid::text) AS holder,
    l.pid                                              AS pid,
    a.application_name                                 AS application_name,
    a.client_addr                                      AS client_addr,
    l.granted                                          AS granted,
    CASE WHEN l.granted THEN coalesce(a.xact_start, a.backend_start)
         ELSE l.waitstart END                          AS since,
    NULL::timestamptz                                  AS expires_at,
    NULL::bigint                                       AS fence,
    CASE WHEN l.granted THEN NULL::integer[]
         ELSE pg_catalog.pg_blocking_pids(l.pid) END   AS blocked_by,
    (l.mode = 'ShareLock')                             AS shared,
    (a.pid IS NOT NULL)                                AS session_alive
FROM pg_catalog.pg_locks AS l
CROSS JOIN LATERAL (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
) AS k
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = k.key AND l.objsubid = 1
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
UNION ALL
SELECT
    'lease'::text,
    s.name,
    NULL::bigint,
    s.holder,
    s.holder_pid,
    a.application_name,
    a.client_addr,
    true,
    s.acquired_at,
    s.expires_at,
    s.fence,
    NULL::integer[],
    false,
    CASE WHEN s.holder_pid IS NULL THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid) END
FROM pgcoord.leases AS s
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = s.holder_pid
WHERE s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp();
