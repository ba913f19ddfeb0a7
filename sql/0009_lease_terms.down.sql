-- pgcoord 0009 down: no history of leadership; 0007's view (the names recorded
-- in pgcoord.lock_names stay: they name the same keys).
DROP TRIGGER lease_names_recorded ON pgcoord.leases;
DROP TRIGGER member_names_forgotten ON pgcoord.member_sessions;
DROP FUNCTION pgcoord.member_names_forget();
DROP FUNCTION pgcoord.lease_names_record();
DROP VIEW pgcoord.lease_history;
DROP TRIGGER lease_terms_forgotten ON pgcoord.leases;
DROP TRIGGER lease_terms_changed ON pgcoord.leases;
DROP TRIGGER lease_terms_started ON pgcoord.leases;
DROP FUNCTION pgcoord.lease_terms_forget();
DROP FUNCTION pgcoord.lease_terms_record();
DROP FUNCTION pgcoord.lease_terms_kept();
DROP TABLE pgcoord.lease_terms;

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

