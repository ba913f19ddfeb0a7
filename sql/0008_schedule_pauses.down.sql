-- pgcoord 0008 down: back to remembering the latest pause only, with 0006's
-- schedule_declare, schedule_update and schedule_take_owed. The schedules' own
-- paused_at/resumed_at (the latest pause) were kept up to date all along.
DROP FUNCTION pgcoord.schedule_take_owed(text[], timestamptz[], boolean[], bigint[], boolean[], text);
CREATE FUNCTION pgcoord.schedule_take_owed(
    jobs text[], ats timestamptz[], runs boolean[], claim_ms bigint[], job_runner text
) RETURNS TABLE (job text, slot_at timestamptz, attempt integer, manual boolean)
    LANGUAGE sql
    AS $body$
        WITH u AS (
            SELECT * FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(ats),
                                     pg_catalog.unnest(runs), pg_catalog.unnest(claim_ms))
                 AS u(job, at, run, claim_ms)
        ), taken AS (
            DELETE FROM pgcoord.schedule_owed AS o
            WHERE (o.name, o.at) IN (SELECT x.name, x.at FROM pgcoord.schedule_owed AS x
                                     JOIN u ON u.job = x.name AND u.at = x.at
                                     FOR UPDATE OF x SKIP LOCKED)
            RETURNING o.name, o.at, o.manual
        )
        INSERT INTO pgcoord.job_slots AS s
            (job, slot_at, manual, state, attempt, runner, started_at, claim_expires_at)
        SELECT t.name, t.at, t.manual, 'running', 1, job_runner, pg_catalog.clock_timestamp(),
               pg_catalog.clock_timestamp() + u.claim_ms * interval '1 millisecond'
        FROM taken AS t
        JOIN u ON u.job = t.name AND u.at = t.at
        WHERE u.run
        ON CONFLICT (job, slot_at) DO NOTHING
        RETURNING s.job, s.slot_at, s.attempt, s.manual
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.schedule_update(
    schedule_name text, changes jsonb, expected_version bigint DEFAULT NULL,
    horizon timestamptz DEFAULT NULL, missed timestamptz[] DEFAULT '{}'
) RETURNS bigint
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        now_ timestamptz;
        new_version bigint;
        now_catch_up text;
        now_deadline double precision;
        now_paused boolean;
    BEGIN
        -- Lock first, then read the clock: a change that waits (for another
        -- change, or for claims being decided under the old version, which hold
        -- FOR KEY SHARE) counts its slots from when it applies, not from when it
        -- was sent; claims decided meanwhile were for slots before that.
        PERFORM 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name FOR UPDATE;
        now_ := pg_catalog.clock_timestamp();
        IF horizon IS NOT NULL AND now_ > horizon THEN
            RETURN NULL;
        END IF;
        UPDATE pgcoord.schedules AS s SET
            handler = coalesce(changes->>'handler', s.handler),
            expr = coalesce(changes->>'expr', s.expr),
            tz = coalesce(changes->>'tz', s.tz),
            args = CASE WHEN changes ? 'args' THEN coalesce(changes->'args', '{}'::jsonb) ELSE s.args END,
            on_crash = coalesce(changes->>'on_crash', s.on_crash),
            catch_up = coalesce(changes->>'catch_up', s.catch_up),
            deadline = CASE WHEN changes ? 'deadline' THEN (changes->>'deadline')::float8 ELSE s.deadline END,
            allow_overlap = coalesce((changes->>'allow_overlap')::boolean, s.allow_overlap),
            timeout = CASE WHEN changes ? 'timeout' THEN (changes->>'timeout')::float8 ELSE s.timeout END,
            max_attempts = coalesce((changes->>'max_attempts')::integer, s.max_attempts),
            since = CASE WHEN (changes ? 'expr' AND changes->>'expr' <> s.expr)
                           OR (changes ? 'tz' AND changes->>'tz' <> s.tz)
                         THEN now_ ELSE s.since END
         WHERE s.name = schedule_name AND (expected_version IS NULL OR s.version = expected_version)
        RETURNING s.version, s.catch_up, s.deadline, s.paused
        INTO new_version, now_catch_up, now_deadline, now_paused;
        IF new_version IS NULL THEN
            RETURN NULL;
        END IF;
        INSERT INTO pgcoord.schedule_owed (name, at, manual)
        SELECT schedule_name, d.m, false
        FROM (SELECT m, pg_catalog.row_number() OVER (ORDER BY m DESC) AS latest,
                     pg_catalog.date_part('epoch', now_ - m) AS late
              FROM pg_catalog.unnest(missed) AS m WHERE m <= now_) AS d
        WHERE NOT now_paused
          AND CASE now_catch_up
                  WHEN 'all' THEN d.late <= coalesce(now_deadline, 'infinity')
                  WHEN 'latest' THEN d.latest = 1 AND d.late <= coalesce(now_deadline, 'infinity')
                  ELSE d.late <= coalesce(now_deadline, 2.0)
              END
          AND NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS j
                          WHERE j.job = schedule_name AND j.slot_at = d.m)
        ON CONFLICT DO NOTHING;
        INSERT INTO pgcoord.job_slots (job, slot_at, state, reason, finished_at)
        SELECT schedule_name, m, 'missed', 'changed', now_
        FROM pg_catalog.unnest(missed) AS m
        WHERE m <= now_
          AND NOT EXISTS (SELECT 1 FROM pgcoord.schedule_owed AS o
                          WHERE o.name = schedule_name AND o.at = m AND NOT o.manual)
        ON CONFLICT (job, slot_at) DO NOTHING;
        RETURN new_version;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.schedule_declare(declared jsonb) RETURNS TABLE (now timestamptz)
    LANGUAGE sql
    SET lock_timeout = '1s'
    AS $body$
        INSERT INTO pgcoord.jobs AS j (job, schedule, tz)
        SELECT d.name, d.expr, d.tz
        FROM pg_catalog.jsonb_to_recordset(declared) AS d(name text, expr text, tz text)
        ON CONFLICT (job) DO UPDATE
            SET schedule = excluded.schedule, tz = excluded.tz,
                updated_at = CASE WHEN (j.schedule, j.tz) = (excluded.schedule, excluded.tz)
                                  THEN j.updated_at ELSE pg_catalog.clock_timestamp() END;
        INSERT INTO pgcoord.schedules AS s
            (name, handler, expr, tz, on_crash, catch_up, deadline, allow_overlap, timeout,
             max_attempts, in_code, since)
        SELECT d.name, d.name, d.expr, d.tz, d.on_crash, d.catch_up, d.deadline, d.allow_overlap,
               d.timeout, d.max_attempts, true,
               coalesce((SELECT j.registered_at FROM pgcoord.jobs AS j WHERE j.job = d.name),
                        pg_catalog.clock_timestamp())
        FROM pg_catalog.jsonb_to_recordset(declared) AS d(
            name text, expr text, tz text, on_crash text, catch_up text, deadline float8,
            allow_overlap boolean, timeout float8, max_attempts integer)
        ORDER BY d.name
        ON CONFLICT (name) DO UPDATE
            SET handler = excluded.handler, expr = excluded.expr, tz = excluded.tz,
                on_crash = excluded.on_crash, catch_up = excluded.catch_up,
                deadline = excluded.deadline, allow_overlap = excluded.allow_overlap,
                timeout = excluded.timeout, max_attempts = excluded.max_attempts, in_code = true
            WHERE (s.handler, s.expr, s.tz, s.on_crash, s.catch_up, s.deadline, s.allow_overlap,
                   s.timeout, s.max_attempts, s.in_code)
                  IS DISTINCT FROM (excluded.handler, excluded.expr, excluded.tz,
                   excluded.on_crash, excluded.catch_up, excluded.deadline,
                   excluded.allow_overlap, excluded.timeout, excluded.max_attempts, true);
        SELECT pg_catalog.clock_timestamp()
    $body$;

DROP TRIGGER schedules_paused_updated ON pgcoord.schedules;
DROP TRIGGER schedules_paused_inserted ON pgcoord.schedules;
DROP FUNCTION pgcoord.schedule_paused();
DROP TABLE pgcoord.schedule_pauses;

ALTER TABLE pgcoord.schedules
    DROP CONSTRAINT schedules_timeout_finite,
    DROP CONSTRAINT schedules_deadline_finite;

-- 0006's schedule_decide and 0003's job_claim, which know no `alone`.
CREATE OR REPLACE FUNCTION pgcoord.schedule_decide(
    jobs text[], ats timestamptz[], versions bigint[], acts text[], reasons text[],
    on_overlaps text[], claim_ms bigint[], job_runner text
) RETURNS TABLE (job text, slot_at timestamptz, state text, attempt integer)
    LANGUAGE sql
    AS $body$
        -- The schedules decided for, held FOR KEY SHARE until this statement
        -- commits: a change (schedule_update locks FOR UPDATE) waits for the
        -- claims made under the old version, and claims wait for the change and
        -- then see its new version (stale). In name order, as every decide.
        WITH held AS MATERIALIZED (
            SELECT s.name, s.version FROM pgcoord.schedules AS s
            WHERE s.name = ANY (jobs)
            ORDER BY s.name
            FOR KEY SHARE
        ), w AS (
            SELECT u.job, u.at, u.act, u.reason, u.on_overlap, u.claim_ms,
                   (s.name IS NOT NULL) AS current
            FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(ats), pg_catalog.unnest(versions),
                           pg_catalog.unnest(acts), pg_catalog.unnest(reasons),
                           pg_catalog.unnest(on_overlaps), pg_catalog.unnest(claim_ms))
                 AS u(job, at, version, act, reason, on_overlap, claim_ms)
            LEFT JOIN held AS s ON s.name = u.job AND s.version = u.version
        ), c AS (
            SELECT w.*,
                   (w.act = 'run' AND w.on_overlap <> 'run' AND (
                       pg_catalog.row_number() OVER (PARTITION BY w.job, w.act ORDER BY w.at) > 1
                       OR EXISTS (SELECT 1 FROM pgcoord.job_slots AS r
                                  WHERE r.job = w.job AND r.state = 'running' AND r.slot_at <> w.at)
                   )) AS overlap
            FROM w
            WHERE w.current
        ), inserted AS (
            INSERT INTO pgcoord.job_slots AS s
                (job, slot_at, state, reason, attempt, runner, started_at, claim_expires_at,
                 finished_at)
            SELECT c.job, c.at,
                   CASE WHEN c.act <> 'run' THEN c.act WHEN c.overlap THEN 'skipped' ELSE 'running' END,
                   CASE WHEN c.act <> 'run' THEN c.reason WHEN c.overlap THEN 'overlap' END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap THEN 1 ELSE 0 END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap THEN job_runner END,
                   CASE WHEN c.act = 'run' THEN pg_catalog.clock_timestamp() END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap
                        THEN pg_catalog.clock_timestamp() + c.claim_ms * interval '1 millisecond' END,
                   CASE WHEN c.act <> 'run' OR c.overlap THEN pg_catalog.clock_timestamp() END
            FROM c
            WHERE NOT (c.overlap AND c.on_overlap = 'wait')
            ORDER BY c.job, c.at
            ON CONFLICT (job, slot_at) DO NOTHING
            RETURNING s.job, s.slot_at, s.state, s.reason, s.attempt
        )
        SELECT i.job, i.slot_at, i.state, i.attempt FROM inserted AS i
        WHERE i.state = 'running' OR i.reason = 'overlap'
        UNION ALL
        SELECT c.job, c.at, 'waiting', 0 FROM c WHERE c.overlap AND c.on_overlap = 'wait'
        UNION ALL
        SELECT w.job, w.at, 'stale', 0 FROM w WHERE NOT w.current
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.job_claim(
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

DROP INDEX pgcoord.job_slots_one_alone;
ALTER TABLE pgcoord.job_slots DROP COLUMN alone;
