-- Reverses 0005: the view as 0004 left it (a column cannot be dropped in place),
-- then the semaphore functions and registry.
DROP VIEW pgcoord.holders;
CREATE VIEW pgcoord.holders AS
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
    ms.name                                            AS member
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
UNION ALL
SELECT
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid) END,
    ms.name
FROM pgcoord.leases AS s
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = s.holder_pid
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = s.holder_pid AND ms.left_at IS NULL
WHERE s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp()
UNION ALL
SELECT
    'job'::text, j.job || ' @ ' || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
    NULL::bigint, j.runner, NULL::integer, NULL::text, NULL::inet, true, j.started_at,
    j.claim_expires_at, j.attempt::bigint, NULL::integer[], false,
    (j.claim_expires_at > pg_catalog.clock_timestamp()),
    ms.name
FROM pgcoord.job_slots AS j
LEFT JOIN pgcoord.member_sessions AS ms
       ON j.runner = ms.name || '/' || ms.id::text AND ms.left_at IS NULL
WHERE j.state = 'running';

COMMENT ON VIEW pgcoord.holders IS
    'pgcoord: one row per current holder or waiter (advisory locks; leases and jobs join in later revisions).';

DROP FUNCTION pgcoord.semaphore_wait_abandon(integer);
DROP FUNCTION pgcoord.semaphore_release(integer, integer);
DROP FUNCTION pgcoord.semaphore_wake(integer);
DROP FUNCTION pgcoord.semaphore_adopt_xact(integer, integer);
DROP FUNCTION pgcoord.semaphore_wait_try(integer, integer, boolean, integer[]);
DROP FUNCTION pgcoord.semaphore_take_xact(integer, integer, integer[], boolean);
DROP FUNCTION pgcoord.semaphore_try(integer, integer, boolean, integer[]);
DROP FUNCTION pgcoord.semaphore_own_lanes(integer);
DROP FUNCTION pgcoord.semaphore_key(text);
DROP TABLE pgcoord.semaphores;
