-- pgcoord 0008: every pause a schedule had, not only the latest. Executed verbatim
-- by migrations/versions/0008_schedule_pauses.py.
--
-- schedules.paused_at/resumed_at remember one pause. When no replica ran during
-- an earlier pause, nothing recorded its slots as they came due, and once a later
-- pause overwrote the pair a replica decided them by catch_up (ran or missed
-- them) instead of skipping them. A slot falls in a pause if it is after
-- paused_at and (once resumed) not after resumed_at.

-- A job that must not overlap never runs beside itself, whichever replicas claim its
-- runs at the same moment (a scheduled slot on one, an owed run or a trigger on
-- another): each statement checks for a run going in its own snapshot, so two of
-- them could both find none. The unique index decides: a second run of the job
-- marked `alone` is not written (ON CONFLICT DO NOTHING), and its slot is decided
-- again at the next tick, when the first is seen going.
ALTER TABLE pgcoord.job_slots ADD COLUMN alone boolean NOT NULL DEFAULT false;
CREATE UNIQUE INDEX job_slots_one_alone ON pgcoord.job_slots (job) WHERE state = 'running' AND alone;

CREATE TABLE pgcoord.schedule_pauses (
    name       text NOT NULL REFERENCES pgcoord.schedules (name) ON DELETE CASCADE,
    paused_at  timestamptz NOT NULL,
    resumed_at timestamptz,          -- NULL: still paused
    PRIMARY KEY (name, paused_at)
);

COMMENT ON TABLE pgcoord.schedule_pauses IS
    'pgcoord: the pauses of each schedule whose slots may not all be decided yet.';

INSERT INTO pgcoord.schedule_pauses (name, paused_at, resumed_at)
SELECT s.name, s.paused_at, CASE WHEN NOT s.paused THEN s.resumed_at END
FROM pgcoord.schedules AS s
WHERE s.paused_at IS NOT NULL;

-- Kept by a trigger on schedules' own pair, so that every way of pausing
-- (schedule_pause, schedule_add(paused), a hand-written UPDATE) leaves a record.
-- A new pause forgets the closed ones whose slots are all decided (up to the
-- latest scheduled slot with a row): the history stays as short as it can be.
CREATE FUNCTION pgcoord.schedule_paused() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        IF NEW.paused_at IS NOT NULL
           AND (TG_OP = 'INSERT' OR NEW.paused_at IS DISTINCT FROM OLD.paused_at) THEN
            DELETE FROM pgcoord.schedule_pauses AS p
             WHERE p.name = NEW.name AND p.resumed_at IS NOT NULL
               AND p.resumed_at <= (SELECT max(j.slot_at) FROM pgcoord.job_slots AS j
                                    WHERE j.job = NEW.name AND NOT j.manual);
            UPDATE pgcoord.schedule_pauses AS p SET resumed_at = NEW.paused_at
             WHERE p.name = NEW.name AND p.resumed_at IS NULL;
            INSERT INTO pgcoord.schedule_pauses (name, paused_at, resumed_at)
            VALUES (NEW.name, NEW.paused_at, CASE WHEN NOT NEW.paused THEN NEW.resumed_at END)
            ON CONFLICT (name, paused_at) DO NOTHING;
        ELSIF NEW.resumed_at IS NOT NULL AND NOT NEW.paused
              AND NEW.resumed_at IS DISTINCT FROM OLD.resumed_at THEN
            UPDATE pgcoord.schedule_pauses AS p SET resumed_at = NEW.resumed_at
             WHERE p.name = NEW.name AND p.resumed_at IS NULL;
        END IF;
        RETURN NULL;
    END
    $body$;

CREATE TRIGGER schedules_paused_inserted AFTER INSERT ON pgcoord.schedules
    FOR EACH ROW WHEN (NEW.paused_at IS NOT NULL)
    EXECUTE FUNCTION pgcoord.schedule_paused();
CREATE TRIGGER schedules_paused_updated AFTER UPDATE ON pgcoord.schedules
    FOR EACH ROW WHEN (OLD.paused_at IS DISTINCT FROM NEW.paused_at
                       OR OLD.resumed_at IS DISTINCT FROM NEW.resumed_at
                       OR OLD.paused IS DISTINCT FROM NEW.paused)
    EXECUTE FUNCTION pgcoord.schedule_paused();

-- A replica's start declares the code's schedules. A changed expr or tz counts
-- slots from the change, as schedule_update does: keeping the old `since` made
-- the new expression's instants since the job's first registration due at once
-- (never due under either expression). Otherwise as in 0006.
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
                timeout = excluded.timeout, max_attempts = excluded.max_attempts, in_code = true,
                since = CASE WHEN (s.expr, s.tz) IS DISTINCT FROM (excluded.expr, excluded.tz)
                             THEN pg_catalog.clock_timestamp() ELSE s.since END
            WHERE (s.handler, s.expr, s.tz, s.on_crash, s.catch_up, s.deadline, s.allow_overlap,
                   s.timeout, s.max_attempts, s.in_code)
                  IS DISTINCT FROM (excluded.handler, excluded.expr, excluded.tz,
                   excluded.on_crash, excluded.catch_up, excluded.deadline,
                   excluded.allow_overlap, excluded.timeout, excluded.max_attempts, true);
        SELECT pg_catalog.clock_timestamp()
    $body$;

-- As in 0006, but the old expression's slots that fall in a pause (any pause of
-- the history, not only the latest) are recorded skipped, reason 'paused', as a
-- replica would have; catch_up decides among the others only.
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
        FROM (SELECT x.m, pg_catalog.row_number() OVER (ORDER BY x.m DESC) AS latest,
                     pg_catalog.date_part('epoch', now_ - x.m) AS late
              FROM pg_catalog.unnest(missed) AS x(m)
              WHERE x.m <= now_
                AND NOT EXISTS (SELECT 1 FROM pgcoord.schedule_pauses AS p
                                WHERE p.name = schedule_name AND x.m > p.paused_at
                                  AND (p.resumed_at IS NULL OR x.m <= p.resumed_at))) AS d
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
        SELECT schedule_name, x.m, CASE WHEN x.paused THEN 'skipped' ELSE 'missed' END,
               CASE WHEN x.paused THEN 'paused' ELSE 'changed' END, now_
        FROM (SELECT u.m, EXISTS (SELECT 1 FROM pgcoord.schedule_pauses AS p
                                  WHERE p.name = schedule_name AND u.m > p.paused_at
                                    AND (p.resumed_at IS NULL OR u.m <= p.resumed_at)) AS paused
              FROM pg_catalog.unnest(missed) AS u(m) WHERE u.m <= now_) AS x
        WHERE NOT EXISTS (SELECT 1 FROM pgcoord.schedule_owed AS o
                          WHERE o.name = schedule_name AND o.at = x.m AND NOT o.manual)
        ON CONFLICT (job, slot_at) DO NOTHING;
        RETURN new_version;
    END
    $body$;

-- Runs owed obey the schedule's overlap rule, as its scheduled slots do: a job
-- that must not overlap (allow_overlap false, per entry in `may_overlap`) takes only
-- its earliest owed run, and only while none of its runs is going; the others stay
-- owed for a later tick. (A catch_up='all' backlog owed by a change of expression
-- started whole at once before.) Otherwise as in 0006.
DROP FUNCTION pgcoord.schedule_take_owed(text[], timestamptz[], boolean[], bigint[], text);
CREATE FUNCTION pgcoord.schedule_take_owed(
    jobs text[], ats timestamptz[], runs boolean[], claim_ms bigint[], may_overlap boolean[],
    job_runner text
) RETURNS TABLE (job text, slot_at timestamptz, attempt integer, manual boolean)
    LANGUAGE sql
    AS $body$
        WITH u AS (
            SELECT * FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(ats),
                                     pg_catalog.unnest(runs), pg_catalog.unnest(claim_ms),
                                     pg_catalog.unnest(may_overlap))
                 AS u(job, at, run, claim_ms, overlap_ok)
        ), locked AS MATERIALIZED (
            SELECT x.name, x.at, u.run, u.claim_ms, u.overlap_ok
            FROM pgcoord.schedule_owed AS x
            JOIN u ON u.job = x.name AND u.at = x.at
            ORDER BY x.name, x.at
            FOR UPDATE OF x SKIP LOCKED
        ), picked AS (
            SELECT l.name, l.at, l.run, l.claim_ms, l.overlap_ok
            FROM locked AS l
            WHERE NOT l.run OR l.overlap_ok
               OR (l.at = (SELECT min(k.at) FROM locked AS k WHERE k.name = l.name AND k.run)
                   AND NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS r
                                   WHERE r.job = l.name AND r.state = 'running'))
        ), started AS (
            INSERT INTO pgcoord.job_slots AS s
                (job, slot_at, manual, state, attempt, runner, started_at, claim_expires_at, alone)
            SELECT p.name, p.at, o.manual, 'running', 1, job_runner, pg_catalog.clock_timestamp(),
                   pg_catalog.clock_timestamp() + p.claim_ms * interval '1 millisecond',
                   NOT p.overlap_ok
            FROM picked AS p
            JOIN pgcoord.schedule_owed AS o ON o.name = p.name AND o.at = p.at
            WHERE p.run
            ON CONFLICT DO NOTHING
            RETURNING s.job, s.slot_at, s.attempt, s.manual
        ), taken AS (
            -- Owed no more: not to run, started, or its slot has a row already. One
            -- that lost to another run of its job started meanwhile (job_slots_one_alone)
            -- stays owed, for a later tick.
            DELETE FROM pgcoord.schedule_owed AS o
            USING picked AS p
            WHERE o.name = p.name AND o.at = p.at
              AND (NOT p.run
                   OR EXISTS (SELECT 1 FROM started AS t WHERE t.job = p.name AND t.slot_at = p.at)
                   OR EXISTS (SELECT 1 FROM pgcoord.job_slots AS r
                              WHERE r.job = p.name AND r.slot_at = p.at))
            RETURNING 1
        )
        -- (taken runs to completion unread, as every data-modifying WITH does.)
        SELECT t.job, t.slot_at, t.attempt, t.manual FROM started AS t
    $body$;

-- A duration NaN or infinite passes `CHECK (timeout > 0)` (NaN is greater than every
-- number in PostgreSQL) and would reach the replicas' timers: refused from now on.
-- NOT VALID: a row written so before is flagged by the library (ScheduleInfo.error)
-- and repaired by update().
ALTER TABLE pgcoord.schedules
    ADD CONSTRAINT schedules_timeout_finite CHECK (timeout < 'Infinity'::double precision) NOT VALID,
    ADD CONSTRAINT schedules_deadline_finite CHECK (deadline < 'Infinity'::double precision) NOT VALID;


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
                 finished_at, alone)
            SELECT c.job, c.at,
                   CASE WHEN c.act <> 'run' THEN c.act WHEN c.overlap THEN 'skipped' ELSE 'running' END,
                   CASE WHEN c.act <> 'run' THEN c.reason WHEN c.overlap THEN 'overlap' END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap THEN 1 ELSE 0 END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap THEN job_runner END,
                   CASE WHEN c.act = 'run' THEN pg_catalog.clock_timestamp() END,
                   CASE WHEN c.act = 'run' AND NOT c.overlap
                        THEN pg_catalog.clock_timestamp() + c.claim_ms * interval '1 millisecond' END,
                   CASE WHEN c.act <> 'run' OR c.overlap THEN pg_catalog.clock_timestamp() END,
                   (c.act = 'run' AND NOT c.overlap AND c.on_overlap <> 'run')
            FROM c
            WHERE NOT (c.overlap AND c.on_overlap = 'wait')
            ORDER BY c.job, c.at
            ON CONFLICT DO NOTHING
            RETURNING s.job, s.slot_at, s.state, s.reason, s.attempt
        )
        SELECT i.job, i.slot_at, i.state, i.attempt FROM inserted AS i
        WHERE i.state = 'running' OR i.reason = 'overlap'
        UNION ALL
        SELECT c.job, c.at, 'waiting', 0 FROM c WHERE c.overlap AND c.on_overlap = 'wait'
        UNION ALL
        -- Not written, and this slot has no row we can see: another run of the job
        -- started meanwhile (job_slots_one_alone). Decided again at the next tick,
        -- as a slot that waits, when that run is seen going.
        SELECT c.job, c.at, 'waiting', 0 FROM c
        WHERE c.act = 'run' AND NOT c.overlap AND c.on_overlap <> 'run'
          AND NOT EXISTS (SELECT 1 FROM inserted AS i WHERE i.job = c.job AND i.slot_at = c.at)
          AND NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS r WHERE r.job = c.job AND r.slot_at = c.at)
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
                 claim_expires_at, finished_at, alone)
            SELECT job_name, at, is_manual,
                   CASE WHEN o.overlap THEN 'skipped' ELSE 'running' END,
                   CASE WHEN o.overlap THEN 'overlap' END,
                   CASE WHEN o.overlap THEN 0 ELSE 1 END,
                   CASE WHEN o.overlap THEN NULL ELSE job_runner END,
                   pg_catalog.clock_timestamp(),
                   CASE WHEN o.overlap THEN NULL
                        ELSE pg_catalog.clock_timestamp() + claim_ms * interval '1 millisecond' END,
                   CASE WHEN o.overlap THEN pg_catalog.clock_timestamp() END,
                   (NOT o.overlap AND on_overlap <> 'run')
            FROM o
            WHERE NOT (o.overlap AND on_overlap = 'wait')
            ON CONFLICT DO NOTHING
            RETURNING s.state, s.attempt
        )
        SELECT claimed.state, claimed.attempt FROM claimed
        UNION ALL
        SELECT 'waiting', 0 FROM o WHERE o.overlap AND on_overlap = 'wait'
        UNION ALL
        -- Not written, and this slot has no row we can see: another run of the job
        -- started meanwhile (job_slots_one_alone). Wait for it, as for an overlap.
        SELECT 'waiting', 0 FROM o
        WHERE NOT o.overlap AND on_overlap <> 'run' AND NOT EXISTS (SELECT 1 FROM claimed)
          AND NOT EXISTS (SELECT 1 FROM pgcoord.job_slots AS r
                          WHERE r.job = job_name AND r.slot_at = at)
    $body$;
