-- pgcoord 0006: schedules are data. Executed verbatim by migrations/versions/0006_schedules.py.

-- One row per schedule, whether a replica's code declared it (@sched.cron, in_code)
-- or someone added it at run time. A schedule's name is its job_slots.job.
CREATE TABLE pgcoord.schedules (
    name          text PRIMARY KEY,
    handler       text NOT NULL,             -- a function registered with @sched.job(handler)
    expr          text NOT NULL,
    tz            text NOT NULL DEFAULT 'UTC',
    args          jsonb NOT NULL DEFAULT '{}'::jsonb,
    paused        boolean NOT NULL DEFAULT false,
    on_crash      text NOT NULL DEFAULT 'skip' CHECK (on_crash IN ('skip', 'retry')),
    catch_up      text NOT NULL DEFAULT 'latest' CHECK (catch_up IN ('latest', 'none', 'all')),
    deadline      double precision CHECK (deadline >= 0),     -- seconds
    allow_overlap boolean NOT NULL DEFAULT false,
    timeout       double precision CHECK (timeout > 0),       -- seconds
    max_attempts  integer NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    in_code       boolean NOT NULL DEFAULT false,
    -- Slots count from here: the schedule's creation, or its last change of expr/tz.
    since         timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    -- The last pause: slots after paused_at (and up to resumed_at once resumed) are
    -- recorded skipped, reason 'paused'.
    paused_at     timestamptz,
    resumed_at    timestamptz,
    -- Bumped by every change; a replica's claims name the version they were worked
    -- out under, and a claim under an older version inserts nothing.
    version       bigint NOT NULL DEFAULT 1,
    created_at    timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);

COMMENT ON TABLE pgcoord.schedules IS
    'pgcoord schedules: what runs when; replicas pick up every change within a second.';

-- Runs owed outside the schedule (trigger from SQL or the CLI, resume with
-- catch_up latest): a replica that has the handler deletes the row and runs it
-- as a manual slot at `at`, so it runs once. A resume's run is owed only if the
-- expression fired in (slot_after, slot_until], the pause: SQL cannot evaluate
-- cron, and job_slots holds a paused slot only if a replica ran meanwhile, so
-- the replica that takes the row works it out (and drops the row if not).
CREATE TABLE pgcoord.schedule_owed (
    name       text NOT NULL REFERENCES pgcoord.schedules (name) ON DELETE CASCADE,
    at         timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    slot_after timestamptz,
    slot_until timestamptz,
    -- false: a scheduled slot owed by a change of expression (see schedule_update),
    -- run as that slot rather than as a manual run.
    manual     boolean NOT NULL DEFAULT true,
    PRIMARY KEY (name, at)
);

-- A counter that every statement changing schedules bumps: replicas compare it
-- each tick (the poll fallback behind poolers, where LISTEN hears nothing).
CREATE TABLE pgcoord.schedule_epoch (
    one   boolean PRIMARY KEY DEFAULT true CHECK (one),
    epoch bigint NOT NULL
);
INSERT INTO pgcoord.schedule_epoch (one, epoch) VALUES (true, 0);

CREATE FUNCTION pgcoord.schedules_versioned() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        NEW.version := OLD.version + 1;
        NEW.updated_at := pg_catalog.clock_timestamp();
        RETURN NEW;
    END
    $body$;

CREATE TRIGGER schedules_versioned BEFORE UPDATE ON pgcoord.schedules
    FOR EACH ROW EXECUTE FUNCTION pgcoord.schedules_versioned();

-- Per statement, not per row: adding 10,000 schedules in one statement is one
-- bump and one notification. A statement that changed no row (a replica's start
-- declaring what is there, a pause of a paused schedule) bumps nothing: every
-- replica would reload every schedule, and the bump locks the counter's row
-- until commit, so that any other change waits for this transaction. Transition
-- tables tell; PostgreSQL allows them on one event per trigger, hence three.
CREATE FUNCTION pgcoord.schedules_changed() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        bumped bigint;
    BEGIN
        IF NOT EXISTS (SELECT 1 FROM changed) THEN
            RETURN NULL;
        END IF;
        UPDATE pgcoord.schedule_epoch SET epoch = epoch + 1 RETURNING epoch INTO bumped;
        PERFORM pg_catalog.pg_notify('pgcoord_schedules', bumped::text);
        RETURN NULL;
    END
    $body$;

CREATE TRIGGER schedules_inserted AFTER INSERT ON pgcoord.schedules
    REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION pgcoord.schedules_changed();
CREATE TRIGGER schedules_updated AFTER UPDATE ON pgcoord.schedules
    REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION pgcoord.schedules_changed();
CREATE TRIGGER schedules_deleted AFTER DELETE ON pgcoord.schedules
    REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION pgcoord.schedules_changed();

CREATE FUNCTION pgcoord.schedule_owed_added() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        IF EXISTS (SELECT 1 FROM added) THEN
            PERFORM pg_catalog.pg_notify('pgcoord_schedules', 'owed');
        END IF;
        RETURN NULL;
    END
    $body$;

CREATE TRIGGER schedule_owed_added AFTER INSERT ON pgcoord.schedule_owed
    REFERENCING NEW TABLE AS added
    FOR EACH STATEMENT EXECUTE FUNCTION pgcoord.schedule_owed_added();

-- Operators' controls. Each returns false for a schedule that does not exist.
-- Pause and resume lock the row FOR UPDATE before reading the clock (as
-- schedule_update does): a plain UPDATE does not wait for the claims being
-- decided under the old version (FOR KEY SHARE), which could commit a run for a
-- slot after the paused_at taken meanwhile.
CREATE FUNCTION pgcoord.schedule_pause(schedule_name text) RETURNS boolean
    LANGUAGE sql
    AS $body$
        SELECT 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name FOR UPDATE;
        WITH paused AS (
            UPDATE pgcoord.schedules AS s
               SET paused = true, paused_at = pg_catalog.clock_timestamp(), resumed_at = NULL
             WHERE s.name = schedule_name AND NOT s.paused
            RETURNING 1
        )
        SELECT EXISTS (SELECT 1 FROM paused)
            OR EXISTS (SELECT 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name)
    $body$;

-- catch_up 'none': the slots skipped while paused stay skipped. 'latest': if a
-- slot fell in the pause, one run is owed now (a manual slot), as if the latest
-- had run late; the replica that takes it checks the expression (see schedule_owed).
CREATE FUNCTION pgcoord.schedule_resume(schedule_name text, catch_up text DEFAULT 'none')
RETURNS boolean
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        was record;
    BEGIN
        IF catch_up IS NULL OR catch_up NOT IN ('none', 'latest') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = 'pgcoord: resume catch_up must be none or latest, not ' || coalesce(catch_up, 'NULL');
        END IF;
        PERFORM 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name FOR UPDATE;
        UPDATE pgcoord.schedules AS s
           SET paused = false, resumed_at = pg_catalog.clock_timestamp()
         WHERE s.name = schedule_name AND s.paused
        RETURNING s.paused_at, s.resumed_at, s.since INTO was;
        IF NOT FOUND THEN
            RETURN EXISTS (SELECT 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name);
        END IF;
        IF catch_up = 'latest' THEN
            INSERT INTO pgcoord.schedule_owed (name, at, slot_after, slot_until)
            VALUES (schedule_name, was.resumed_at,
                    GREATEST(coalesce(was.paused_at, was.since), was.since), was.resumed_at)
            ON CONFLICT DO NOTHING;
        END IF;
        RETURN true;
    END
    $body$;

-- Code-declared schedules belong to the code that declares them: removing one
-- here would only last until a replica restarts.
CREATE FUNCTION pgcoord.schedule_remove(schedule_name text) RETURNS boolean
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        IF EXISTS (SELECT 1 FROM pgcoord.schedules AS s WHERE s.name = schedule_name AND s.in_code) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = 'pgcoord: schedule ' || schedule_name || ' is declared in code (@sched.cron); remove it there';
        END IF;
        DELETE FROM pgcoord.schedules AS s WHERE s.name = schedule_name;
        RETURN FOUND;
    END
    $body$;

-- One run now, by a replica that has the handler; returns the run's instant
-- (its job_slots.slot_at, manual), or NULL for no such schedule.
CREATE FUNCTION pgcoord.schedule_trigger(schedule_name text) RETURNS timestamptz
    LANGUAGE sql
    AS $body$
        INSERT INTO pgcoord.schedule_owed (name, at)
        SELECT s.name, pg_catalog.clock_timestamp() FROM pgcoord.schedules AS s
        WHERE s.name = schedule_name
        RETURNING at
    $body$;

-- Add a schedule (the caller has checked expr and tz: pgcoord's add() does).
CREATE FUNCTION pgcoord.schedule_add(
    schedule_name text, schedule_handler text, schedule_expr text, schedule_tz text,
    schedule_args jsonb, options jsonb
) RETURNS boolean
    LANGUAGE sql
    AS $body$
        INSERT INTO pgcoord.schedules AS s
            (name, handler, expr, tz, args, paused, paused_at, on_crash, catch_up, deadline,
             allow_overlap, timeout, max_attempts)
        VALUES (schedule_name, schedule_handler, schedule_expr, schedule_tz,
                coalesce(schedule_args, '{}'::jsonb),
                coalesce((options->>'paused')::boolean, false),
                CASE WHEN (options->>'paused')::boolean THEN pg_catalog.clock_timestamp() END,
                coalesce(options->>'on_crash', 'skip'), coalesce(options->>'catch_up', 'latest'),
                (options->>'deadline')::float8, coalesce((options->>'allow_overlap')::boolean, false),
                (options->>'timeout')::float8, coalesce((options->>'max_attempts')::integer, 3))
        ON CONFLICT (name) DO NOTHING
        RETURNING true
    $body$;

-- Change a schedule, optimistically: only while it is still at expected_version
-- (NULL: whatever it is) and the clock has not passed horizon (NULL: no limit).
-- A change of expr or tz starts counting slots afresh from now; the old
-- expression's slots due before now that nobody recorded (`missed`, worked out
-- by the caller up to horizon) are decided here by the schedule's catch_up and
-- deadline, as a replica would have: those it would run are owed as scheduled
-- slots (a replica runs each once, late), the others recorded missed, reason
-- 'changed'; so every slot still ends with a row, and a change made just after
-- a slot came due does not cost that run. (Paused: all missed.) Keys of
-- `changes` not given keep their value.
CREATE FUNCTION pgcoord.schedule_update(
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

-- Declare the code's schedules (one JSON object each) at a replica's start. The
-- code owns expr, tz and options; paused and args stay as operators left them.
-- A new row counts slots from the job's old pgcoord.jobs registration, if any.
-- Bounded (lock_timeout): a transaction holding a change of these rows open
-- must not keep a starting replica from running; it declares again later.
CREATE FUNCTION pgcoord.schedule_declare(declared jsonb) RETURNS TABLE (now timestamptz)
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

-- One tick of a replica, for every schedule due at once. Each entry is a slot
-- (job, at) worked out under schedule version `version`, with what to do: 'run'
-- (claim it as running), or a terminal state to record ('missed', 'skipped')
-- with its reason. An entry whose schedule is gone or at another version does
-- nothing and comes back 'stale' (the replica reloads). For a run, when another
-- slot of the job is running (or an earlier one of this batch), on_overlap
-- decides: 'run' anyway, record it 'skip'ped, or 'wait' (insert nothing, back as
-- 'waiting'). Inserting in (job, at) order keeps replicas that race on the same
-- batch from deadlocking. Returns the runs claimed and the entries not done.
CREATE FUNCTION pgcoord.schedule_decide(
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

-- Claims whose runner stopped heartbeating, for many jobs at once: abandon them,
-- or (retry) take over the earliest one per job as the next attempt. Returns the
-- slots this runner now runs. The expired claims are found first (few, from the
-- partial index of running slots) and the jobs' options looked up by position;
-- the rows are then updated by ctid. Joining the arrays to job_slots instead lets
-- the planner, whose statistics lag behind a burst of claims, pick a nested loop
-- of every running slot against every job (seconds for 10,000 schedules).
-- Abandoning needs no handler, so expired claims of jobs this replica does not
-- run are abandoned too when nobody could take them over: the schedule was
-- removed, or it does not retry (or has used its attempts). Otherwise a removed
-- schedule's slot, or one whose handler only a dead replica had, stayed running.
CREATE FUNCTION pgcoord.schedule_recover(
    jobs text[], claim_ms bigint[], retries boolean[], max_attempts integer[], job_runner text
) RETURNS TABLE (job text, slot_at timestamptz, attempt integer)
    LANGUAGE sql
    AS $body$
        UPDATE pgcoord.job_slots AS s
           SET state = 'abandoned',
               reason = CASE WHEN e.p IS NULL AND e.gone THEN 'runner lost; schedule removed'
                             WHEN (e.p IS NOT NULL AND retries[e.p])
                               OR (e.p IS NULL AND e.on_crash = 'retry')
                             THEN 'runner lost; attempts used up'
                             ELSE 'runner lost' END,
               finished_at = pg_catalog.clock_timestamp(), claim_expires_at = NULL
          FROM (SELECT x.ctid AS id, x.attempt, pg_catalog.array_position(jobs, x.job) AS p,
                       sc.name IS NULL AS gone, sc.on_crash, sc.max_attempts AS most
                FROM pgcoord.job_slots AS x
                LEFT JOIN pgcoord.schedules AS sc ON sc.name = x.job
                WHERE x.state = 'running' AND x.claim_expires_at < pg_catalog.clock_timestamp()
                OFFSET 0) AS e
         WHERE s.ctid = e.id AND s.state = 'running'
           AND s.claim_expires_at < pg_catalog.clock_timestamp()
           AND CASE WHEN e.p IS NOT NULL THEN NOT retries[e.p] OR s.attempt >= max_attempts[e.p]
                    ELSE e.gone OR e.on_crash = 'skip' OR s.attempt >= e.most END;
        UPDATE pgcoord.job_slots AS s
           SET attempt = s.attempt + 1, runner = job_runner, started_at = pg_catalog.clock_timestamp(),
               claim_expires_at = pg_catalog.clock_timestamp() + claim_ms[e.p] * interval '1 millisecond'
          FROM (SELECT DISTINCT ON (x.job) x.ctid AS id, x.p
                FROM (SELECT y.ctid, y.job, y.slot_at, y.attempt,
                             pg_catalog.array_position(jobs, y.job) AS p
                      FROM pgcoord.job_slots AS y
                      WHERE y.state = 'running' AND y.claim_expires_at < pg_catalog.clock_timestamp()
                      OFFSET 0) AS x
                WHERE x.p IS NOT NULL AND retries[x.p] AND x.attempt < max_attempts[x.p]
                ORDER BY x.job, x.slot_at) AS e
         WHERE s.ctid = e.id AND s.state = 'running'
           AND s.claim_expires_at < pg_catalog.clock_timestamp()
        RETURNING s.job, s.slot_at, s.attempt
    $body$;

-- Retention for many jobs at once: per job, finished rows older than its keep_ms,
-- never the latest scheduled slot (due-ness counts from it); at most batch rows.
CREATE FUNCTION pgcoord.schedule_prune(jobs text[], keep_ms bigint[], batch integer)
RETURNS integer
    LANGUAGE sql
    AS $body$
        WITH doomed AS (
            SELECT d.ctid
            FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(keep_ms)) AS u(job, keep_ms)
            CROSS JOIN LATERAL (
                SELECT s.ctid FROM pgcoord.job_slots AS s
                WHERE s.job = u.job AND s.state <> 'running'
                  AND s.finished_at < pg_catalog.clock_timestamp() - u.keep_ms * interval '1 millisecond'
                  AND s.slot_at < (SELECT max(l.slot_at) FROM pgcoord.job_slots AS l
                                   WHERE l.job = u.job AND NOT l.manual)
                LIMIT batch
            ) AS d
            LIMIT batch
        ), deleted AS (
            DELETE FROM pgcoord.job_slots AS s USING doomed WHERE s.ctid = doomed.ctid RETURNING 1
        )
        SELECT count(*)::integer FROM deleted
    $body$;

-- Runs owed (schedule_trigger, resume with catch_up latest), one entry per owed
-- row (job, at) as schedule_tick listed it: each row is taken by one replica,
-- and claimed as a manual running slot if `runs` says so (false: a resume whose
-- pause had no slot, which the replica worked out; the row is only dropped).
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

-- Record the ends of many runs at once (job_finish for each entry, in order): a
-- replica that started 10,000 slots in one tick does not send 10,000 statements
-- to say how they went. Each row is looked up by its key (a lateral subquery,
-- so the plan is one index probe per entry whatever the statistics say: they
-- lag behind a burst of claims) and locked in (job, slot_at) order, so two such
-- statements (or a recovery pass) cannot deadlock; then updated by ctid.
-- Returns, per entry in order, whether it was recorded (false: taken over).
CREATE FUNCTION pgcoord.schedule_finish(
    jobs text[], ats timestamptz[], runners text[], attempts integer[], final_states text[],
    final_reasons text[], final_errors text[]
) RETURNS boolean[]
    LANGUAGE sql
    AS $body$
        WITH u AS (
            SELECT * FROM ROWS FROM (pg_catalog.unnest(jobs), pg_catalog.unnest(ats),
                                     pg_catalog.unnest(runners), pg_catalog.unnest(attempts),
                                     pg_catalog.unnest(final_states), pg_catalog.unnest(final_reasons),
                                     pg_catalog.unnest(final_errors))
                 WITH ORDINALITY AS u(job, at, runner, attempt, state, reason, error, ord)
        ), locked AS (
            SELECT x.id, o.ord, o.state, o.reason, o.error
            FROM (SELECT * FROM u ORDER BY u.job, u.at) AS o
            CROSS JOIN LATERAL (
                SELECT s.ctid AS id FROM pgcoord.job_slots AS s
                WHERE s.job = o.job AND s.slot_at = o.at AND s.runner = o.runner
                  AND s.attempt = o.attempt AND s.state = 'running'
                FOR UPDATE
            ) AS x
        ), finished AS (
            UPDATE pgcoord.job_slots AS s
               SET state = l.state, reason = l.reason, error = l.error,
                   finished_at = pg_catalog.clock_timestamp(), claim_expires_at = NULL
              FROM locked AS l
             WHERE s.ctid = l.id
            RETURNING l.ord
        )
        SELECT coalesce(pg_catalog.array_agg(f.ord IS NOT NULL ORDER BY u.ord), '{}')
        FROM u LEFT JOIN finished AS f ON f.ord = u.ord
    $body$;
