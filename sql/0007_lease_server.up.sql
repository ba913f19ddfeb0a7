-- pgcoord 0007: a lease's session is judged gone only on the server it lived on.
-- Executed verbatim by migrations/versions/0007_lease_server.py.
--
-- A lease that names its holder's session (elector leases, leases of a Member) may
-- be taken over as soon as that session is gone, without waiting out the ttl:
-- the holder heard of its own session's end first. That holds on one server. After
-- a failover (a standby promoted) or a restart, the new server has no such session
-- to look for: the holder may still be running, on a half-open connection to a
-- primary whose host vanished, and believes until its trust window closes. So a
-- lease row remembers which server incarnation its session was on, and a session
-- of another incarnation counts as alive: the lease is taken over when it expires,
-- after its holder stopped believing.

ALTER TABLE pgcoord.leases ADD COLUMN holder_server text;
COMMENT ON COLUMN pgcoord.leases.holder_server IS
    'pgcoord: the server incarnation (pgcoord.server_incarnation()) holder_pid belongs to.';

-- This server's incarnation: when its postmaster started and its WAL timeline.
-- A promotion changes the timeline; a stop and start changes the start time. A
-- crash restart (a backend killed, the postmaster reinitialising in place) keeps
-- both: that is fine, since every session and its doorbell are gone with it, so a
-- lease is taken over at once, as before 0007. NULL on a standby, which writes no
-- lease rows and whose timeline is not yet its own.
CREATE FUNCTION pgcoord.server_incarnation() RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN
        EXTRACT(epoch FROM pg_catalog.pg_postmaster_start_time())::text || '/' ||
        pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8)
    END;

-- Every write that names a holder's session also names the incarnation, whichever
-- statement does it (acquire, a member moving its leases to a new session, partitions).
CREATE FUNCTION pgcoord.leases_note_server() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
BEGIN
    NEW.holder_server := CASE WHEN NEW.holder_pid IS NOT NULL THEN pgcoord.server_incarnation() END;
    RETURN NEW;
END
$body$;

CREATE TRIGGER leases_note_server BEFORE INSERT OR UPDATE OF holder_pid ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.leases_note_server();

-- Rows written before now name no incarnation, and renewals never write holder_pid,
-- so the trigger would never stamp them: their sessions are on this server.
UPDATE pgcoord.leases SET holder_server = pgcoord.server_incarnation() WHERE holder_pid IS NOT NULL;

-- True while the session that took a lease still holds its doorbell, and also while
-- that session lived on another incarnation of the server (it cannot be looked up
-- here: the lease expires instead). The caller passes the row's holder_server, so
-- the function reads no table: the operator role, granted only pgcoord.holders,
-- calls it through the view. The incarnation is compared first, being cheap.
CREATE FUNCTION pgcoord.lease_session_alive(lease_name text, pid integer, server text) RETURNS boolean
    LANGUAGE sql STABLE
    RETURN pid IS NOT NULL AND (
        (server IS NOT NULL AND server IS DISTINCT FROM pgcoord.server_incarnation())
        OR EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.granted AND l.pid = lease_session_alive.pid
              AND l.objsubid = 1
              AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lease_doorbell_key(lease_name)
        )
    );

CREATE OR REPLACE FUNCTION pgcoord.lease_acquire(
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
                   AND NOT pgcoord.lease_session_alive(l.name, l.holder_pid, l.holder_server))
        RETURNING l.fence, l.expires_at
    $body$;

CREATE OR REPLACE VIEW pgcoord.holders AS
WITH sem AS MATERIALIZED (
    -- Registered semaphore keys as pg_locks shows them (classid is an unsigned
    -- oid); names that collide on a key are listed together.
    SELECT (s.key::bigint & 4294967295)::oid AS classid, s.key,
           pg_catalog.string_agg(s.name, ' | ' ORDER BY s.name) AS name
    FROM pgcoord.semaphores AS s
    GROUP BY s.key
)
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
    (a.pid IS NOT NULL)                                AS session_alive,
    ms.name                                            AS member,
    NULL::integer                                      AS lane
FROM pg_catalog.pg_locks AS l
CROSS JOIN LATERAL (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
) AS k
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = k.key AND l.objsubid = 1
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = l.pid AND ms.left_at IS NULL
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
  AND NOT (l.objsubid = 2 AND l.classid IN (SELECT sem.classid FROM sem))
UNION ALL
-- A granted lane is a holder; the waiting room (lane -1) holds the waiters,
-- shown as not granted, with `since` NULL (see 0005).
SELECT
    'semaphore'::text, sem.name, sem.key::bigint,
    coalesce(nullif(a.application_name, ''), 'pid ' || l.pid::text), l.pid,
    a.application_name, a.client_addr,
    (l.objid <> 4294967295::oid),
    CASE WHEN l.objid <> 4294967295::oid THEN coalesce(a.xact_start, a.backend_start) END,
    NULL::timestamptz, NULL::bigint, NULL::integer[], false, (a.pid IS NOT NULL), ms.name,
    CASE WHEN l.objid <> 4294967295::oid THEN l.objid::bigint::integer END
FROM pg_catalog.pg_locks AS l
JOIN sem ON sem.classid = l.classid
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = l.pid AND ms.left_at IS NULL
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
UNION ALL
-- A session of another server incarnation cannot be looked up here: it is
-- neither alive nor dead (NULL), and its pid may be an unrelated session's.
SELECT
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL OR NOT here.here THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid, s.holder_server) END,
    ms.name, NULL::integer
FROM pgcoord.leases AS s
CROSS JOIN LATERAL (
    SELECT s.holder_server IS NULL OR s.holder_server = pgcoord.server_incarnation() AS here
) AS here
LEFT JOIN pg_catalog.pg_stat_activity AS a ON here.here AND a.pid = s.holder_pid
LEFT JOIN pgcoord.member_sessions AS ms ON here.here AND ms.pid = s.holder_pid AND ms.left_at IS NULL
WHERE s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp()
UNION ALL
SELECT
    'job'::text, j.job || ' @ ' || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
    NULL::bigint, j.runner, NULL::integer, NULL::text, NULL::inet, true, j.started_at,
    j.claim_expires_at, j.attempt::bigint, NULL::integer[], false,
    (j.claim_expires_at > pg_catalog.clock_timestamp()),
    ms.name, NULL::integer
FROM pgcoord.job_slots AS j
LEFT JOIN pgcoord.member_sessions AS ms
       ON j.runner = ms.name || '/' || ms.id::text AND ms.left_at IS NULL
WHERE j.state = 'running';

-- Members live on one server incarnation too. After a failover a member's row names a
-- session the new primary cannot see: its running job claims are then not expired at
-- once (a runner cut off by a vanished host may still run its slot), but expire on
-- their own, as its leases do. Rows that exist now are of this incarnation.
ALTER TABLE pgcoord.member_sessions ADD COLUMN server text DEFAULT pgcoord.server_incarnation();
UPDATE pgcoord.member_sessions SET server = pgcoord.server_incarnation() WHERE server IS NULL;

CREATE OR REPLACE FUNCTION pgcoord.job_expire_member_claims(member_id integer) RETURNS integer
    LANGUAGE sql
    AS $body$
        WITH expired AS (
            UPDATE pgcoord.job_slots AS s
               SET claim_expires_at = pg_catalog.clock_timestamp()
             WHERE s.state = 'running'
               AND s.runner = (SELECT m.name || '/' || m.id::text FROM pgcoord.member_sessions AS m
                               WHERE m.id = member_id AND m.left_at IS NOT NULL
                                 AND m.server IS NOT DISTINCT FROM pgcoord.server_incarnation())
               AND s.claim_expires_at > pg_catalog.clock_timestamp()
            RETURNING 1
        )
        SELECT count(*)::integer FROM expired
    $body$;

-- Only the doorbell; nothing calls it any more, and a caller that did would miss
-- the incarnation.
DROP FUNCTION pgcoord.lease_session_alive(text, integer);
