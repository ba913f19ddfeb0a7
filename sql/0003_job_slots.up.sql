-- pgcoord 0003: run-once cron. Executed verbatim by migrations/versions/0003_job_slots.py.

-- Jobs that some replica has registered: due-ness counts from registered_at.
CREATE TABLE pgcoord.jobs (
    job           text PRIMARY KEY,
    schedule      text NOT NULL,
    tz            text NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);

-- One row per (job, scheduled instant in UTC): the primary key is what makes
-- each slot start exactly once. Manual runs (trigger) are flagged and never
-- count as scheduled slots.
CREATE TABLE pgcoord.job_slots (
    job              text NOT NULL,
    slot_at          timestamptz NOT NULL,
    manual           boolean NOT NULL DEFAULT false,
    state            text NOT NULL CHECK (state IN
                        ('running', 'succeeded', 'failed', 'abandoned', 'missed', 'skipped')),
    reason           text,
    attempt          integer NOT NULL DEFAULT 0,   -- the claim's fence
    runner           text,
    started_at       timestamptz,
    finished_at      timestamptz,
    claim_expires_at timestamptz,                  -- the running claim is a lease
    error            text,
    PRIMARY KEY (job, slot_at)
);

CREATE INDEX job_slots_running ON pgcoord.job_slots (job, claim_expires_at) WHERE state = 'running';
CREATE INDEX job_slots_finished ON pgcoord.job_slots (job, finished_at);

COMMENT ON TABLE pgcoord.job_slots IS
    'pgcoord run-once cron: one row per job and scheduled instant, in a terminal state once done.';

-- Register (or re-register) a job; returns when it was first registered and the
-- database's clock now.
CREATE FUNCTION pgcoord.job_register(job_name text, job_schedule text, job_tz text)
RETURNS TABLE (registered_at timestamptz, now timestamptz)
    LANGUAGE sql
    AS $body$
        INSERT INTO pgcoord.jobs AS j (job, schedule, tz) VALUES (job_name, job_schedule, job_tz)
        ON CONFLICT (job) DO UPDATE
            SET schedule = excluded.schedule, tz = excluded.tz,
                updated_at = CASE WHEN (j.schedule, j.tz) = (excluded.schedule, excluded.tz)
                                  THEN j.updated_at ELSE pg_catalog.clock_timestamp() END
        RETURNING j.registered_at, pg_catalog.clock_timestamp()
    $body$;

-- Claim a slot: insert it as running. When another slot of the job is still
-- running, on_overlap decides: 'run' anyway, record this one 'skip'ped, or
-- 'wait' (insert nothing, return state 'waiting': claim it on a later tick).
-- No row back means another replica got there first.
CREATE FUNCTION pgcoord.job_claim(
    job_name text, at timestamptz, job_runner text, claim_ms bigint, on_overlap text,
    is_manual boolean
) RETURNS TABLE (state text, attempt integer)
    LANGUAGE sql
    AS $body$
        WITH o AS (
            SELECT on_overlap <> 'run' AND EXISTS (
                       SELECT 1 FROM pgcoord.job_slots AS r
                       WHERE r.job = job_name AND r.state = 'running' AND r.slot_at <> at
                   ) AS overlap
        ), claimed AS (
            INSERT INTO pgcoord.job_slots AS s
                (job, slot_at, manual, state, reason, attempt, runner, started_at,
                 claim_expires_at, finished_at)
            SELECT job_name, at, is_manual,
                   CASE WHEN o.overlap THEN 'skipped' ELSE 'running' END,
                   CASE WHEN o.overlap THEN 'overlap' END,
                   CASE WHEN o.overlap THEN 0 ELSE 1 END,
                   CASE WHEN o.overlap THEN NULL ELSE job_runner END,
                   pg_catalog.clock_timestamp(),
                   CASE WHEN o.overlap THEN NULL
                        ELSE pg_catalog.clock_timestamp() + claim_ms * interval '1 millisecond' END,
                   CASE WHEN o.overlap THEN pg_catalog.clock_timestamp() END
            FROM o
            WHERE NOT (o.overlap AND on_overlap = 'wait')
            ON CONFLICT (job, slot_at) DO NOTHING
            RETURNING s.state, s.attempt
        )
        SELECT claimed.state, claimed.attempt FROM claimed
        UNION ALL
        SELECT 'waiting', 0 FROM o WHERE o.overlap AND on_overlap = 'wait'
    $body$;

-- Extend a running claim; false once another runner has taken the slot over.
CREATE FUNCTION pgcoord.job_heartbeat(
    job_name text, at timestamptz, job_runner text, job_attempt integer, claim_ms bigint
) RETURNS boolean
    LANGUAGE sql
    AS $body$
        WITH renewed AS (
            UPDATE pgcoord.job_slots AS s
               SET claim_expires_at = pg_catalog.clock_timestamp() + claim_ms * interval '1 millisecond'
             WHERE s.job = job_name AND s.slot_at = at AND s.runner = job_runner
               AND s.attempt = job_attempt AND s.state = 'running'
            RETURNING 1
        )
        SELECT EXISTS (SELECT 1 FROM renewed)
    $body$;

-- Record a run's end; only the current runner and attempt can. Run it in the
-- job's own transaction for transactional jobs, so both commit or neither.
CREATE FUNCTION pgcoord.job_finish(
    job_name text, at timestamptz, job_runner text, job_attempt integer, final_state text,
    final_reason text, final_error text
) RETURNS boolean
    LANGUAGE sql
    AS $body$
        WITH finished AS (
            UPDATE pgcoord.job_slots AS s
               SET state = final_state, reason = final_reason, error = final_error,
                   finished_at = pg_catalog.clock_timestamp(), claim_expires_at = NULL
             WHERE s.job = job_name AND s.slot_at = at AND s.runner = job_runner
               AND s.attempt = job_attempt AND s.state = 'running'
            RETURNING 1
        )
        SELECT EXISTS (SELECT 1 FROM finished)
    $body$;

-- Record slots nobody will run (catch-up policy, deadline) as missed.
CREATE FUNCTION pgcoord.job_mark_missed(job_name text, slots timestamptz[], why text)
RETURNS integer
    LANGUAGE sql
    AS $body$
        WITH marked AS (
            INSERT INTO pgcoord.job_slots (job, slot_at, state, reason, finished_at)
            SELECT job_name, slot, 'missed', why, pg_catalog.clock_timestamp()
            FROM pg_catalog.unnest(slots) AS slot
            ON CONFLICT (job, slot_at) DO NOTHING
            RETURNING 1
        )
        SELECT count(*)::integer FROM marked
    $body$;

-- Claims whose runner stopped heartbeating: abandon them, or (retry) take one
-- over with the next attempt. Returns the slot this runner now runs, if any.
CREATE FUNCTION pgcoord.job_recover(
    job_name text, job_runner text, claim_ms bigint, retry boolean, max_attempts integer
) RETURNS TABLE (slot_at timestamptz, attempt integer)
    LANGUAGE sql
    AS $body$
        UPDATE pgcoord.job_slots AS s
           SET state = 'abandoned',
               reason = CASE WHEN retry THEN 'runner lost; attempts used up' ELSE 'runner lost' END,
               finished_at = pg_catalog.clock_timestamp(), claim_expires_at = NULL
         WHERE s.job = job_name AND s.state = 'running'
           AND s.claim_expires_at < pg_catalog.clock_timestamp()
           AND (NOT retry OR s.attempt >= max_attempts);
        UPDATE pgcoord.job_slots AS s
           SET attempt = s.attempt + 1, runner = job_runner, started_at = pg_catalog.clock_timestamp(),
               claim_expires_at = pg_catalog.clock_timestamp() + claim_ms * interval '1 millisecond'
         WHERE (s.job, s.slot_at) = (
                   SELECT e.job, e.slot_at FROM pgcoord.job_slots AS e
                   WHERE e.job = job_name AND e.state = 'running'
                     AND e.claim_expires_at < pg_catalog.clock_timestamp() AND retry
                     AND e.attempt < max_attempts
                   ORDER BY e.slot_at LIMIT 1 FOR UPDATE SKIP LOCKED)
        RETURNING s.slot_at, s.attempt
    $body$;

-- Delete finished rows older than keep_ms, at most batch of them, never the
-- latest scheduled slot (due-ness counts from it) and never a running one.
CREATE FUNCTION pgcoord.job_prune(job_name text, keep_ms bigint, batch integer)
RETURNS integer
    LANGUAGE sql
    AS $body$
        WITH doomed AS (
            SELECT s.ctid FROM pgcoord.job_slots AS s
            WHERE s.job = job_name AND s.state <> 'running'
              AND s.finished_at < pg_catalog.clock_timestamp() - keep_ms * interval '1 millisecond'
              AND s.slot_at < (SELECT max(l.slot_at) FROM pgcoord.job_slots AS l
                               WHERE l.job = job_name AND NOT l.manual)
            LIMIT batch
        ), deleted AS (
            DELETE FROM pgcoord.job_slots AS s USING doomed WHERE s.ctid = doomed.ctid RETURNING 1
        )
        SELECT count(*)::integer FROM deleted
    $body$;

-- The view gains a row per running job slot.
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
