-- Queries of the operators' dashboard (pgcoord.web). Every one returns a single
-- row of JSON text, so that every driver hands back the same shape. The dashboard
-- runs them under the operator role of sql/roles.sql (SELECT only).

-- name: web_sample
-- What every page shows, read once a second at most by the one sampler of a
-- process (pg_locks copies the lock table, so pages never read it themselves).
-- Holders: every column of the view, and the ages `pgcoord status --json` adds
-- (holders_list), so /api/locks gives the rows it prints, in its order. Leases are
-- all of them, released ones too: an election whose holder is gone is what the
-- "no leader" alert is about.
SELECT pg_catalog.json_build_object(
    'now', pg_catalog.clock_timestamp(),
    'server_version', pg_catalog.current_setting('server_version'),
    'database', pg_catalog.current_database(),
    'holders', (SELECT coalesce(pg_catalog.json_agg(h ORDER BY h.kind, coalesce(h.name, h.key::text),
                                                      h.granted DESC, h.since), '[]'::json) FROM (
        SELECT v.*,
               extract(epoch FROM pg_catalog.now() - v.since)::float8 AS age_seconds,
               extract(epoch FROM v.expires_at - pg_catalog.now())::float8 AS expires_in_seconds
        FROM pgcoord.holders AS v) AS h),
    'leases', (SELECT coalesce(pg_catalog.json_agg(l ORDER BY l.name), '[]'::json) FROM (
        SELECT s.name, s.holder, s.fence, s.acquired_at, s.renewed_at, s.expires_at, s.holder_pid,
               (s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp()) AS held,
               extract(epoch FROM pg_catalog.clock_timestamp() - s.acquired_at)::float8 AS term_seconds,
               extract(epoch FROM s.expires_at - pg_catalog.clock_timestamp())::float8 AS left_seconds
        FROM pgcoord.leases AS s) AS l),
    'members', (SELECT coalesce(pg_catalog.json_agg(m ORDER BY m."group", m.name), '[]'::json) FROM (
        SELECT m.id, m."group", m.name, m.meta, m.pid, m.application_name, m.joined_at,
               m.heartbeat_at, m.has_session,
               extract(epoch FROM pg_catalog.clock_timestamp() - m.joined_at)::float8 AS age_seconds
        FROM pgcoord.members AS m) AS m)
)::text

-- name: web_terms_installed
-- Whether the leadership history (migration 0009) is there to read.
SELECT pg_catalog.to_regclass('pgcoord.lease_history') IS NOT NULL

-- name: web_terms
-- The last $1 terms of every lease name, latest first: who held it, from when to
-- when, its fence, and how it ended (NULL while it runs). lease_history also ends
-- a term that ran out unrecorded (expired, nobody took the lease since).
SELECT coalesce(pg_catalog.json_agg(t ORDER BY t.name, t.fence DESC), '[]'::json)::text
FROM (
    SELECT t.name, t.fence, t.holder, t.holder_pid, t.started_at, t.ended_at, t.ended_how,
           extract(epoch FROM coalesce(t.ended_at, pg_catalog.clock_timestamp()) - t.started_at)::float8
               AS held_seconds,
           t.resign_requested_at,
           pg_catalog.row_number() OVER (PARTITION BY t.name ORDER BY t.fence DESC) AS n
    FROM pgcoord.lease_history AS t
) AS t
WHERE t.n <= $1

-- name: web_slots
-- One page of a schedule's slots, latest first: $1 the job, $2 how many, $3 how
-- many to skip; with the total, for the pager.
WITH p AS (SELECT CAST($1 AS text) AS job, CAST($2 AS integer) AS size, CAST($3 AS integer) AS skip)
SELECT pg_catalog.json_build_object(
    'total', (SELECT count(*) FROM pgcoord.job_slots AS j, p WHERE j.job = p.job),
    'slots', (SELECT coalesce(pg_catalog.json_agg(h ORDER BY h.slot_at DESC), '[]'::json)
              FROM (SELECT j.slot_at, j.manual, j.state, j.reason, j.attempt, j.runner, j.started_at,
                           j.finished_at, j.error
                    FROM pgcoord.job_slots AS j, p WHERE j.job = p.job
                    ORDER BY j.slot_at DESC LIMIT (SELECT p.size FROM p)
                    OFFSET (SELECT p.skip FROM p)) AS h)
)::text

-- name: web_schedules_mark
-- What moves when the lean rows of web_schedules (the dear part of a reading at
-- 10,000 schedules) may have: the schedules' count, versions (an update bumps its
-- row's) and latest creation (not schedule_epoch: the operator role of roles.sql
-- may not read it), the running slots (a slot started or ended), and job_slots'
-- cumulative row counts (a slot begun and ended between two readings; other
-- backends flush those within about a second, hence also a full reading every
-- SCHEDULES_EVERY seconds).
SELECT pg_catalog.json_build_array(
    (SELECT pg_catalog.json_build_array(count(*), sum(s.version), max(s.created_at))
     FROM pgcoord.schedules AS s),
    (SELECT pg_catalog.json_agg(pg_catalog.json_build_array(r.job, r.slot_at, r.attempt)
                                ORDER BY r.job, r.slot_at)
     FROM pgcoord.job_slots AS r WHERE r.state = 'running'),
    pg_catalog.pg_stat_get_tuples_inserted('pgcoord.job_slots'::regclass)
        + pg_catalog.pg_stat_get_tuples_updated('pgcoord.job_slots'::regclass)
        + pg_catalog.pg_stat_get_tuples_deleted('pgcoord.job_slots'::regclass))::text

-- name: web_schedules
-- Every schedule for the sampler, lean (10,000 of them are read every second while a
-- page is open): what the overview counts and what tells a page that a schedule
-- changed or a slot started or ended. The failures in a row are counted only where
-- the latest run failed (else there are none).
SELECT coalesce(pg_catalog.json_agg(pg_catalog.json_build_array(
           x.name, x.paused, x.version, x.last_run_at, x.last_state, x.failures_in_row)
       ORDER BY x.name), '[]')::text
FROM (
    SELECT s.name, s.paused, s.version, l.slot_at AS last_run_at, l.state AS last_state,
           CASE WHEN l.state IN ('failed', 'abandoned') THEN
               (SELECT count(*) FROM pgcoord.job_slots AS f
                WHERE f.job = s.name AND f.state IN ('failed', 'abandoned')
                  AND f.slot_at > coalesce((SELECT max(k.slot_at) FROM pgcoord.job_slots AS k
                                            WHERE k.job = s.name AND k.state = 'succeeded'),
                                           '-infinity'))::integer
           ELSE 0 END AS failures_in_row
    FROM pgcoord.schedules AS s
    LEFT JOIN LATERAL (SELECT j.slot_at, j.state FROM pgcoord.job_slots AS j
                       WHERE j.job = s.name ORDER BY j.slot_at DESC LIMIT 1) AS l ON true
) AS x

-- name: web_schedule_rows
-- The schedules named in $1 as schedule_list gives them (`pgcoord jobs --json`): the
-- rows of one page of /schedules.
SELECT pg_catalog.clock_timestamp(), coalesce(pg_catalog.json_agg(x ORDER BY x.name), '[]')::text
FROM (
    SELECT s.name, s.handler, s.expr, s.tz, s.args, s.paused, s.on_crash, s.catch_up,
           s.deadline, s.allow_overlap, s.timeout, s.max_attempts, s.in_code, s.since,
           s.paused_at, s.created_at, s.updated_at, s.version,
           l.slot_at AS last_run_at, l.state AS last_state, l.reason AS last_reason,
           (SELECT count(*) FROM pgcoord.job_slots AS f
            WHERE f.job = s.name AND f.state IN ('failed', 'abandoned')
              AND f.slot_at > coalesce((SELECT max(k.slot_at) FROM pgcoord.job_slots AS k
                                        WHERE k.job = s.name AND k.state = 'succeeded'),
                                       '-infinity'))::integer AS failures_in_row
    FROM pgcoord.schedules AS s
    LEFT JOIN LATERAL (SELECT j.slot_at, j.state, j.reason FROM pgcoord.job_slots AS j
                       WHERE j.job = s.name ORDER BY j.slot_at DESC LIMIT 1) AS l ON true
    WHERE s.name = ANY (CAST($1 AS text[]))
) AS x
