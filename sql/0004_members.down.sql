-- Reverses 0004: the view as 0003 left it (a column cannot be dropped in place),
-- then the rest.
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
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid) END
FROM pgcoord.leases AS s
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = s.holder_pid
WHERE s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp()
UNION ALL
SELECT
    'job'::text, j.job || ' @ ' || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
    NULL::bigint, j.runner, NULL::integer, NULL::text, NULL::inet, true, j.started_at,
    j.claim_expires_at, j.attempt::bigint, NULL::integer[], false,
    (j.claim_expires_at > pg_catalog.clock_timestamp())
FROM pgcoord.job_slots AS j
WHERE j.state = 'running';

COMMENT ON VIEW pgcoord.holders IS
    'pgcoord: one row per current holder or waiter (advisory locks; leases and jobs join in later revisions).';

DROP FUNCTION pgcoord.lease_bind_session(text, text, bigint, integer);
DROP FUNCTION pgcoord.job_expire_member_claims(integer);
DROP FUNCTION pgcoord.lease_renew_asking(text, text, bigint, bigint);
DROP FUNCTION pgcoord.request_resign(text);
DROP TRIGGER lease_news ON pgcoord.leases;
DROP FUNCTION pgcoord.lease_news();
ALTER TABLE pgcoord.leases DROP COLUMN resign_requested_at;
DROP FUNCTION pgcoord.member_heartbeat(integer);
DROP FUNCTION pgcoord.member_reap(integer);
DROP FUNCTION pgcoord.member_leave(integer);
DROP FUNCTION pgcoord.member_join(text, text, jsonb, integer, text, boolean);
DROP FUNCTION pgcoord.member_reap_group(text);
DROP FUNCTION pgcoord.member_mark_gone(integer, text);
DROP FUNCTION pgcoord.member_notify(text, text, integer, text);
DROP FUNCTION pgcoord.member_left_reason(timestamptz, integer);
DROP VIEW pgcoord.members;
DROP FUNCTION pgcoord.member_sessions_alive();
DROP FUNCTION pgcoord.member_alive_ns();
DROP TABLE pgcoord.member_sessions;
DROP SEQUENCE pgcoord.member_ids;
