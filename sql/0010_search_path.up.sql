-- pgcoord 0010: every function pins its search_path, and pgcoord's own NOTIFYs
-- are sent only when some session listens for them (issue 23).
-- Executed verbatim by migrations/versions/0010_search_path.py.
--
-- Before PostgreSQL 19 every NOTIFY signals every listening session of the
-- database, on any channel, and its commit takes a database-wide lock (one
-- notifying committer at a time). A NOTIFY that nobody hears still pays both.
-- So a session that LISTENs to one of pgcoord's broadcast channels first says so
-- (pgcoord.ears_open), and the statements that tell news ask before they NOTIFY
-- (pgcoord.notify_heard). The register is two advisory locks per channel, in a
-- key space of their own ('pgcn' = 1885823854, two-int form):
--   (ns, code)       "ears": held shared, at session level, by each registered
--                    listener; gone with its session, so a crashed listener
--                    never leaves a false "someone listens" behind.
--   (ns, code + 100) "gate": held shared until commit by each teller that found
--                    nobody listening. A new listener takes it exclusively once
--                    (waiting for those tellers to commit) before it LISTENs and
--                    looks: a change it could miss was committed before it looked.
-- The semaphores' channel keeps its own register (the waiting room, 0005).

CREATE FUNCTION pgcoord.ears_ns() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pgcoord, pg_temp
    RETURN 1885823854;

-- The channels with a register; NULL for any other (always told).
CREATE FUNCTION pgcoord.ears_code(channel text) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    SET search_path = pg_catalog, pgcoord, pg_temp
    RETURN CASE channel WHEN 'pgcoord_leases' THEN 1 WHEN 'pgcoord_members' THEN 2
                        WHEN 'pgcoord_schedules' THEN 3 WHEN 'pgcoord_partitions' THEN 4 END;

-- Register this session as a listener of `channel`, before its LISTEN. Waits
-- for tellers that decided "nobody listens" to commit, at most 200 ms: a longer
-- one (a change held open in someone's transaction) is not worth stalling a
-- shared session for; its news then reaches this listener by the fallback every
-- listener has (a periodic look). False for a channel without a register.
CREATE FUNCTION pgcoord.ears_open(channel text) RETURNS boolean
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        code integer := pgcoord.ears_code(channel);
        saved text := pg_catalog.current_setting('lock_timeout');
    BEGIN
        IF code IS NULL THEN
            RETURN false;
        END IF;
        PERFORM pg_catalog.pg_advisory_lock_shared(pgcoord.ears_ns(), code);
        BEGIN
            PERFORM pg_catalog.set_config('lock_timeout', '200ms', true);
            PERFORM pg_catalog.pg_advisory_lock(pgcoord.ears_ns(), code + 100);
            PERFORM pg_catalog.pg_advisory_unlock(pgcoord.ears_ns(), code + 100);
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
        PERFORM pg_catalog.set_config('lock_timeout', saved, true);
        RETURN true;
    END
    $body$;

-- After the UNLISTEN: this session no longer listens to `channel`.
CREATE FUNCTION pgcoord.ears_close(channel text) RETURNS boolean
    LANGUAGE sql
    SET search_path = pg_catalog, pgcoord, pg_temp
    RETURN CASE WHEN pgcoord.ears_code(channel) IS NULL THEN false
                ELSE pg_catalog.pg_advisory_unlock_shared(pgcoord.ears_ns(), pgcoord.ears_code(channel)) END;

-- NOTIFY `channel` if a session listens to it: a registered one, or this very
-- session (which cannot see its own register) unless `mine` says that the news is
-- of no use to it. True when it was sent.
CREATE FUNCTION pgcoord.notify_heard(channel text, payload text, mine boolean DEFAULT true)
    RETURNS boolean
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        code integer := pgcoord.ears_code(channel);
    BEGIN
        -- One test at a time (SQL does not promise to evaluate AND left to right):
        -- the exclusive try on the ears is taken only when the gate was, and always
        -- given back at once.
        IF code IS NOT NULL AND NOT (mine AND EXISTS (
               SELECT 1 FROM pg_catalog.pg_listening_channels() AS l(c) WHERE l.c = channel)) THEN
            IF pg_catalog.pg_try_advisory_xact_lock_shared(pgcoord.ears_ns(), code + 100) THEN
                IF pg_catalog.pg_try_advisory_lock(pgcoord.ears_ns(), code) THEN
                    PERFORM pg_catalog.pg_advisory_unlock(pgcoord.ears_ns(), code);
                    RETURN false;   -- nobody listens, and nobody starts before we commit
                END IF;
            END IF;
        END IF;
        PERFORM pg_catalog.pg_notify(channel, payload);
        RETURN true;
    END
    $body$;

-- 0004's membership news, told only when heard. A joining session listens before
-- it joins (so that it misses nothing after), but its own join is no news to it.
CREATE OR REPLACE FUNCTION pgcoord.member_notify(ev text, grp text, member_id integer, reason text)
    RETURNS void
    LANGUAGE sql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
        SELECT pgcoord.notify_heard('pgcoord_members',
            pg_catalog.json_build_object('ev', ev, 'group', grp, 'id', member_id,
                                         'reason', reason)::text,
            ev <> 'joined')
    $body$;

-- 0004's lease news, told only when heard, and once per change. It was told from
-- the BEFORE INSERT OR UPDATE trigger, which an upsert (lease_acquire's INSERT ...
-- ON CONFLICT DO UPDATE) fires twice: for the row it proposes (told as acquired
-- with the old fence, though no row was inserted) and for the update. An AFTER
-- trigger fires only for what happened. The BEFORE trigger keeps the one thing it
-- must do before the write: a resign request is for the term it was made in. A
-- renewal changes neither holder nor fence and tells nothing, as before.
CREATE OR REPLACE FUNCTION pgcoord.lease_news() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    BEGIN
        IF TG_OP = 'UPDATE' AND NEW.fence IS DISTINCT FROM OLD.fence THEN
            NEW.resign_requested_at := NULL;
        END IF;
        RETURN NEW;
    END
    $body$;

CREATE FUNCTION pgcoord.lease_told() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    BEGIN
        IF TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence
           OR NEW.holder IS DISTINCT FROM OLD.holder THEN
            PERFORM pgcoord.notify_heard('pgcoord_leases', pg_catalog.json_build_object(
                'ev', CASE WHEN NEW.holder IS NULL THEN 'released' ELSE 'acquired' END,
                'name', NEW.name, 'holder', NEW.holder, 'fence', NEW.fence)::text);
        ELSIF NEW.resign_requested_at IS NOT NULL AND OLD.resign_requested_at IS NULL THEN
            PERFORM pgcoord.notify_heard('pgcoord_leases', pg_catalog.json_build_object(
                'ev', 'resign', 'name', NEW.name, 'holder', NEW.holder, 'fence', NEW.fence)::text);
        END IF;
        RETURN NULL;
    END
    $body$;

-- A renewal (the hot path: every holder, every ttl/3) does not even call it.
CREATE TRIGGER lease_told AFTER INSERT ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.lease_told();
CREATE TRIGGER lease_told_changed AFTER UPDATE ON pgcoord.leases
    FOR EACH ROW
    WHEN (NEW.fence IS DISTINCT FROM OLD.fence OR NEW.holder IS DISTINCT FROM OLD.holder
          OR (NEW.resign_requested_at IS NOT NULL AND OLD.resign_requested_at IS NULL))
    EXECUTE FUNCTION pgcoord.lease_told();

-- A watcher granted a dead member's lock reaps every dead member at once (deaths
-- come together: a process with several members, a host). Told in one NOTIFY per
-- group (per hundred dead, to stay well under the 8000-byte payload limit) rather
-- than one per dead member: each listening session is signalled once, not once per
-- death. The payload keeps the first death's "id" and "reason", as one death's news
-- has them, and lists them all in "ids" ([[id, reason], ...]). Returns what this
-- statement marked, as [[id, reason], ...] (a member marked already was told by
-- whoever marked it). Replaces the runtime statement of the same name, which marked
-- and told them one by one.
CREATE FUNCTION pgcoord.member_reap_dead() RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        chunk record;
        marked jsonb := '[]'::jsonb;
    BEGIN
        FOR chunk IN
            WITH alive AS MATERIALIZED (SELECT a.id, a.pid FROM pgcoord.member_sessions_alive() AS a),
            gone AS (
                UPDATE pgcoord.member_sessions AS m
                   SET left_at = pg_catalog.clock_timestamp(),
                       left_reason = pgcoord.member_left_reason(m.heartbeat_at, m.ttl_ms)
                 WHERE m.left_at IS NULL AND m.has_session
                   AND NOT EXISTS (SELECT 1 FROM alive AS a WHERE a.id = m.id AND a.pid = m.pid)
                RETURNING m.id, m."group" AS grp, m.left_reason AS why
            ),
            numbered AS (
                SELECT g.id, g.grp, g.why,
                       (pg_catalog.row_number() OVER (PARTITION BY g.grp ORDER BY g.id) - 1) / 100 AS part
                FROM gone AS g
            )
            SELECT n.grp, pg_catalog.jsonb_agg(pg_catalog.jsonb_build_array(n.id, n.why) ORDER BY n.id) AS ids
            FROM numbered AS n
            GROUP BY n.grp, n.part
        LOOP
            marked := marked || chunk.ids;
            PERFORM pgcoord.notify_heard('pgcoord_members', pg_catalog.json_build_object(
                'ev', 'left', 'group', chunk.grp, 'id', chunk.ids -> 0 -> 0,
                'reason', chunk.ids -> 0 ->> 1, 'ids', chunk.ids)::text);
        END LOOP;
        RETURN marked::text;
    END
    $body$;

-- 0006's schedule news, told only when heard. The counter still moves: every
-- replica reads it each tick, which is how one that does not listen learns.
CREATE OR REPLACE FUNCTION pgcoord.schedules_changed() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        bumped bigint;
    BEGIN
        IF NOT EXISTS (SELECT 1 FROM changed) THEN
            RETURN NULL;
        END IF;
        UPDATE pgcoord.schedule_epoch SET epoch = epoch + 1 RETURNING epoch INTO bumped;
        PERFORM pgcoord.notify_heard('pgcoord_schedules', bumped::text);
        RETURN NULL;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.schedule_owed_added() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    BEGIN
        IF EXISTS (SELECT 1 FROM added) THEN
            PERFORM pgcoord.notify_heard('pgcoord_schedules', 'owed');
        END IF;
        RETURN NULL;
    END
    $body$;

-- 0004's live-member read, bound when created: a SQL-standard body (BEGIN ATOMIC)
-- is parsed once, here, so a caller's search_path cannot change what its names and
-- operators mean, and it can still be inlined into pgcoord.members (a SET clause
-- would forbid that: measured, it made member_heartbeat 1.6x slower). Created
-- through EXECUTE, with this migration's own search_path pinned meanwhile, since the
-- body's semicolons would split the file.
DO $bind$
DECLARE
    saved text := pg_catalog.current_setting('search_path');
BEGIN
    PERFORM pg_catalog.set_config('search_path', 'pg_catalog, pgcoord, pg_temp', true);
    EXECUTE $fn$
        CREATE OR REPLACE FUNCTION pgcoord.member_sessions_alive() RETURNS TABLE (id integer, pid integer)
            LANGUAGE sql STABLE
        BEGIN ATOMIC
            SELECT l.objid::bigint::integer, l.pid
            FROM pg_catalog.pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
              AND l.classid = pgcoord.member_alive_ns()::oid
              AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                                WHERE d.datname = pg_catalog.current_database());
        END
    $fn$;
    PERFORM pg_catalog.set_config('search_path', saved, true);
END
$bind$;

-- Every other function of the schema whose body is a string, parsed at each call
-- under the caller's search_path: a role's own search_path (a schema of its own
-- first, holding a table, a function or an operator of the same name) must not
-- change what pgcoord's functions mean. Also pins any such function an earlier
-- migration added; a function created or replaced later must carry the clause
-- itself, or have a SQL-standard body (RETURN, BEGIN ATOMIC), bound when created
-- and left unpinned so that it can be inlined (tests/integration/test_search_path.py
-- checks that every function is one or the other).
DO $pin$
DECLARE
    fn text;
BEGIN
    FOR fn IN
        SELECT 'pgcoord.' || pg_catalog.quote_ident(p.proname) || '('
               || pg_catalog.pg_get_function_identity_arguments(p.oid) || ')'
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace = 'pgcoord'::regnamespace AND p.prokind IN ('f', 'p')
          AND p.prosqlbody IS NULL
          AND NOT EXISTS (SELECT 1 FROM pg_catalog.unnest(p.proconfig) AS c(s)
                          WHERE pg_catalog.starts_with(c.s, 'search_path='))
    LOOP
        -- (no format(): the migration runner reads a percent sign as a placeholder)
        EXECUTE 'ALTER FUNCTION ' || fn || ' SET search_path = pg_catalog, pgcoord, pg_temp';
    END LOOP;
END
$pin$;
