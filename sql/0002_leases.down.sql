-- Reverses 0002: the view as 0001 left it, then the lease objects.
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
    (l.mode = 'ShareLock')                             AS shared
FROM pg_catalog.pg_locks AS l
CROSS JOIN LATERAL (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
) AS k
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = k.key AND l.objsubid = 1
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database());
COMMENT ON VIEW pgcoord.holders IS
    'pgcoord: one row per current holder or waiter (advisory locks; leases and jobs join in later revisions).';
DROP FUNCTION IF EXISTS pgcoord.check_fence(text, bigint);
DROP FUNCTION IF EXISTS pgcoord.lease_release(text, text, bigint);
DROP FUNCTION IF EXISTS pgcoord.lease_renew(text, text, bigint, bigint);
DROP FUNCTION IF EXISTS pgcoord.lease_acquire(text, text, bigint, integer);
DROP FUNCTION IF EXISTS pgcoord.lease_session_alive(text, integer);
DROP FUNCTION IF EXISTS pgcoord.lease_doorbell_key(text);
DROP TABLE IF EXISTS pgcoord.leases;
