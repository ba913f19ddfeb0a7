-- Reverses 0003: the view as 0002 left it, then the job objects.
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
DROP FUNCTION IF EXISTS pgcoord.job_prune(text, bigint, integer);
DROP FUNCTION IF EXISTS pgcoord.job_recover(text, text, bigint, boolean, integer);
DROP FUNCTION IF EXISTS pgcoord.job_mark_missed(text, timestamptz[], text);
DROP FUNCTION IF EXISTS pgcoord.job_finish(text, timestamptz, text, integer, text, text, text);
DROP FUNCTION IF EXISTS pgcoord.job_heartbeat(text, timestamptz, text, integer, bigint);
DROP FUNCTION IF EXISTS pgcoord.job_claim(text, timestamptz, text, bigint, text, boolean);
DROP FUNCTION IF EXISTS pgcoord.job_register(text, text, text);
DROP TABLE IF EXISTS pgcoord.job_slots;
DROP TABLE IF EXISTS pgcoord.jobs;
