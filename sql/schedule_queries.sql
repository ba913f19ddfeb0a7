-- Runtime SQL of schedules (DESIGN §9), in the format of queries.sql. Lists go
-- in as arrays and come back as arrays, so that a tick over every due schedule
-- is one statement, not one per schedule. CAST($n AS type[]), not $n::type[]:
-- SQLAlchemy's text() reads ":p1::" as no parameter at all.

-- name: schedule_tick
-- Each tick: the database clock, the schedules' change counter (a replica that
-- sees it move reloads: the poll behind poolers, where LISTEN hears nothing) and
-- the runs owed, column by column (name, at, and the pause a resume's run is
-- owed for, if any).
SELECT pg_catalog.clock_timestamp(), e.epoch, o.*
FROM pgcoord.schedule_epoch AS e
CROSS JOIN (SELECT pg_catalog.array_agg(o.name ORDER BY o.name, o.at),
                   pg_catalog.array_agg(o.at ORDER BY o.name, o.at),
                   pg_catalog.array_agg(o.slot_after ORDER BY o.name, o.at),
                   pg_catalog.array_agg(o.slot_until ORDER BY o.name, o.at)
            FROM pgcoord.schedule_owed AS o) AS o

-- name: schedule_tick_on_member
-- schedule_tick on a member's session: the same row, its lock waits bounded to 100 ms
-- (pgcoord.schedule_tick_read, 0011).
SELECT * FROM pgcoord.schedule_tick_read()

-- name: schedule_load
-- Every schedule this replica can run ($1: handlers registered with @sched.job;
-- $2: the names it declared with @sched.cron), column by column, with the latest
-- scheduled slot of each (NULL arrays for none), and its pauses not yet all decided
-- (JSON [[paused_at, resumed_at], ...], or NULL); $3, if not NULL: only those so
-- named (the ones schedule_versions showed changed). The counter is read in the
-- same snapshot.
SELECT e.epoch, pg_catalog.clock_timestamp(), a.*
FROM pgcoord.schedule_epoch AS e
CROSS JOIN LATERAL (
    SELECT pg_catalog.array_agg(s.name ORDER BY s.name), pg_catalog.array_agg(s.handler ORDER BY s.name),
           pg_catalog.array_agg(s.expr ORDER BY s.name), pg_catalog.array_agg(s.tz ORDER BY s.name),
           pg_catalog.array_agg(s.args::text ORDER BY s.name),
           pg_catalog.array_agg(s.paused ORDER BY s.name),
           pg_catalog.array_agg(s.on_crash ORDER BY s.name),
           pg_catalog.array_agg(s.catch_up ORDER BY s.name),
           pg_catalog.array_agg(s.deadline ORDER BY s.name),
           pg_catalog.array_agg(s.allow_overlap ORDER BY s.name),
           pg_catalog.array_agg(s.timeout ORDER BY s.name),
           pg_catalog.array_agg(s.max_attempts ORDER BY s.name),
           pg_catalog.array_agg(s.in_code ORDER BY s.name),
           pg_catalog.array_agg(s.since ORDER BY s.name),
           pg_catalog.array_agg(s.paused_at ORDER BY s.name),
           pg_catalog.array_agg(s.resumed_at ORDER BY s.name),
           pg_catalog.array_agg(s.version ORDER BY s.name),
           pg_catalog.array_agg(m.last ORDER BY s.name),
           pg_catalog.array_agg(p.pauses ORDER BY s.name)
    FROM pgcoord.schedules AS s
    CROSS JOIN LATERAL (SELECT pg_catalog.max(j.slot_at) AS last FROM pgcoord.job_slots AS j
                        WHERE j.job = s.name AND NOT j.manual) AS m
    CROSS JOIN LATERAL (
        SELECT pg_catalog.json_agg(pg_catalog.json_build_array(
                   pg_catalog.to_char(h.paused_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                   pg_catalog.to_char(h.resumed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
                   ORDER BY h.paused_at)::text AS pauses
        FROM pgcoord.schedule_pauses AS h
        WHERE h.name = s.name
          AND (h.resumed_at IS NULL OR h.resumed_at > coalesce(m.last, s.since))) AS p
    WHERE ((NOT s.in_code AND s.handler = ANY (CAST($1 AS text[])))
           OR (s.in_code AND s.name = ANY (CAST($2 AS text[]))))
      AND s.name = ANY (coalesce(CAST($3 AS text[]), ARRAY[s.name]))
) AS a

-- name: schedule_versions
-- The version of every schedule this replica can run (as schedule_load picks
-- them), with its `since` (a schedule removed and added again starts at version 1
-- again, from a new `since`), and the counter, in one snapshot: a reload after a
-- change loads only the schedules whose version moved (one, for one change), not
-- all 10,000.
SELECT e.epoch, v.*
FROM pgcoord.schedule_epoch AS e
CROSS JOIN (SELECT pg_catalog.array_agg(s.name), pg_catalog.array_agg(s.version),
                   pg_catalog.array_agg(s.since)
            FROM pgcoord.schedules AS s
            WHERE (NOT s.in_code AND s.handler = ANY (CAST($1 AS text[])))
               OR (s.in_code AND s.name = ANY (CAST($2 AS text[])))) AS v

-- name: schedule_declare
SELECT now FROM pgcoord.schedule_declare(CAST($1 AS jsonb))

-- name: schedule_decide
SELECT pg_catalog.array_agg(d.job), pg_catalog.array_agg(d.slot_at),
       pg_catalog.array_agg(d.state), pg_catalog.array_agg(d.attempt)
FROM pgcoord.schedule_decide(CAST($1 AS text[]), CAST($2 AS timestamptz[]), CAST($3 AS bigint[]),
                             CAST($4 AS text[]), CAST($5 AS text[]), CAST($6 AS text[]),
                             CAST($7 AS bigint[]), $8) AS d

-- name: schedule_recover
SELECT pg_catalog.array_agg(r.job), pg_catalog.array_agg(r.slot_at), pg_catalog.array_agg(r.attempt)
FROM pgcoord.schedule_recover(CAST($1 AS text[]), CAST($2 AS bigint[]), CAST($3 AS boolean[]),
                              CAST($4 AS integer[]), $5) AS r

-- name: schedule_take_owed
SELECT pg_catalog.array_agg(t.job), pg_catalog.array_agg(t.slot_at), pg_catalog.array_agg(t.attempt),
       pg_catalog.array_agg(t.manual)
FROM pgcoord.schedule_take_owed(CAST($1 AS text[]), CAST($2 AS timestamptz[]),
                                CAST($3 AS boolean[]), CAST($4 AS bigint[]),
                                CAST($5 AS boolean[]), $6) AS t

-- name: schedule_prune
SELECT pgcoord.schedule_prune(CAST($1 AS text[]), CAST($2 AS bigint[]), $3)

-- name: schedule_watch
-- Every schedule not paused, whoever runs it (a schedule whose handler no replica
-- registers is failing too), for the failing-job alert, column by column: slots
-- count from its creation or last change of expression, or from its last resume
-- (the pause's slots were skipped, not failed).
SELECT pg_catalog.clock_timestamp(), pg_catalog.array_agg(s.name ORDER BY s.name),
       pg_catalog.array_agg(s.handler ORDER BY s.name), pg_catalog.array_agg(s.expr ORDER BY s.name),
       pg_catalog.array_agg(s.tz ORDER BY s.name),
       pg_catalog.array_agg(GREATEST(s.since, s.resumed_at) ORDER BY s.name)
FROM pgcoord.schedules AS s
WHERE NOT s.paused

-- name: schedule_failing
-- Of the given schedules, those with no success in the span of their last K
-- expected slots (from the given instant, the first of them): no run of one of
-- those slots, and no run that ended in that span, succeeded. A run of one of
-- those slots still going (its claim alive) clears the schedule, unless the latest
-- run that ended failed or was abandoned (not by a replica's graceful stop): a slow
-- job is not failing for the slots skipped while it runs, and a run going after one
-- that failed does not hide it. A run going since before the span (hung, or slower
-- than K periods) clears nothing, nor does a dead runner's row that no replica reaps.
SELECT pg_catalog.array_agg(u.name)
FROM ROWS FROM (pg_catalog.unnest(CAST($1 AS text[])), pg_catalog.unnest(CAST($2 AS timestamptz[])))
     AS u(name, since)
WHERE NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS j
                  WHERE j.job = u.name AND j.slot_at >= u.since AND j.state = 'succeeded')
  AND NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS j
                  WHERE j.job = u.name AND j.finished_at >= u.since AND j.state = 'succeeded')
  AND (NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS j
                   WHERE j.job = u.name AND j.slot_at >= u.since AND j.state = 'running'
                     AND j.claim_expires_at > pg_catalog.clock_timestamp())
       OR coalesce((SELECT j.state <> 'succeeded' FROM pgcoord.job_slots AS j
                    WHERE j.job = u.name AND j.finished_at IS NOT NULL
                      AND j.state IN ('succeeded', 'failed', 'abandoned')
                      AND (j.state <> 'abandoned' OR j.reason IS DISTINCT FROM 'stopped')
                    ORDER BY j.finished_at DESC LIMIT 1), false))

-- name: schedule_add
SELECT pgcoord.schedule_add($1, $2, $3, $4, CAST($5 AS jsonb), CAST($6 AS jsonb))

-- name: schedule_get
-- One schedule with the database clock and its latest scheduled slot (for update()).
SELECT s.expr, s.tz, s.since, s.version, s.in_code, pg_catalog.clock_timestamp(),
       (SELECT pg_catalog.max(j.slot_at) FROM pgcoord.job_slots AS j WHERE j.job = s.name AND NOT j.manual)
FROM pgcoord.schedules AS s WHERE s.name = $1

-- name: schedule_update
SELECT pgcoord.schedule_update($1, CAST($2 AS jsonb), $3, $4, CAST($5 AS timestamptz[]))

-- name: schedule_pause
SELECT pgcoord.schedule_pause($1)

-- name: schedule_resume
SELECT pgcoord.schedule_resume($1, $2)

-- name: schedule_remove
SELECT pgcoord.schedule_remove($1)

-- name: schedule_trigger
SELECT pgcoord.schedule_trigger($1)

-- name: schedule_list
-- Every schedule ($1: or the one so named) as a JSON array, with its latest run
-- (any slot, manual included), its latest scheduled slot and its failures in a
-- row (failed or abandoned since its latest success): schedules() and `pgcoord jobs`.
SELECT pg_catalog.clock_timestamp(), coalesce(pg_catalog.json_agg(x ORDER BY x.name), '[]')::text
FROM (
    SELECT s.name, s.handler, s.expr, s.tz, s.args, s.paused, s.on_crash, s.catch_up,
           s.deadline, s.allow_overlap, s.timeout, s.max_attempts, s.in_code, s.since,
           s.paused_at, s.created_at, s.updated_at, s.version,
           l.slot_at AS last_run_at, l.state AS last_state, l.reason AS last_reason,
           (SELECT pg_catalog.max(j.slot_at) FROM pgcoord.job_slots AS j
            WHERE j.job = s.name AND NOT j.manual) AS last_slot_at,
           (SELECT pg_catalog.count(*) FROM pgcoord.job_slots AS f
            WHERE f.job = s.name AND f.state IN ('failed', 'abandoned')
              AND f.slot_at > coalesce((SELECT pg_catalog.max(k.slot_at) FROM pgcoord.job_slots AS k
                                        WHERE k.job = s.name AND k.state = 'succeeded'),
                                       '-infinity'))::integer AS failures_in_row
    FROM pgcoord.schedules AS s
    LEFT JOIN LATERAL (SELECT j.slot_at, j.state, j.reason FROM pgcoord.job_slots AS j
                       WHERE j.job = s.name ORDER BY j.slot_at DESC LIMIT 1) AS l ON true
    WHERE s.name = coalesce(CAST($1 AS text), s.name)
) AS x

-- name: schedule_history
-- The latest $2 slots of job $1, latest first, as a JSON array.
SELECT coalesce(pg_catalog.json_agg(h ORDER BY h.slot_at DESC), '[]')::text
FROM (SELECT slot_at, manual, state, reason, attempt, runner, started_at, finished_at, error
      FROM pgcoord.job_slots WHERE job = $1 ORDER BY slot_at DESC LIMIT $2) AS h

-- name: schedule_finish
SELECT pgcoord.schedule_finish(CAST($1 AS text[]), CAST($2 AS timestamptz[]), CAST($3 AS text[]),
                               CAST($4 AS integer[]), CAST($5 AS text[]), CAST($6 AS text[]),
                               CAST($7 AS text[]))
