-- pgcoord 0011: a member's heartbeat in one statement, which sweeps its group only
-- when no older member of the group is sweeping, and reads the group without
-- pg_locks.
--
-- Before, each heartbeat (every ttl/3, for every member) swept its group and then read
-- it, in two statements that each scanned pg_locks (which takes every lock-manager
-- partition lock, stalling every other session's lock acquisition meanwhile): at 100
-- members, 60 scans a second and most of what the members cost the server
-- (docs/performance.md, "The NOTIFY tax"). The sweep is a fallback (deaths are told by
-- the watcher ring within milliseconds; the sweep finds the members whose watcher was
-- paused itself, and the sessionless members whose heartbeats stopped): one sweeper per
-- group is enough, the member with the lowest id among those whose heartbeat is fresh
-- (younger than half the shorter of its ttl and the asker's). If it stops beating, the
-- next one sweeps within a half ttl. Members behind a pooler sweep at every beat. The group read without pg_locks may list a dead member not yet swept: in
-- the ring, its watcher is granted its lock at once and reaps it.

CREATE FUNCTION pgcoord.member_beat(member_id integer, want_state boolean) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        grp text;
        own_ttl integer;
        own_session boolean;
    BEGIN
        UPDATE pgcoord.member_sessions SET heartbeat_at = pg_catalog.clock_timestamp()
        WHERE id = member_id AND left_at IS NULL
        RETURNING "group", ttl_ms, has_session INTO grp, own_ttl, own_session;
        IF grp IS NULL THEN
            RETURN NULL;  -- declared dead: the member joins again
        END IF;
        -- A member behind a pooler (no session) always sweeps: it learns of departures
        -- by reading the group next, and a departure it finds unmarked would be told
        -- without its reason. Fresh is judged on the shorter of the two ttls, so that a
        -- member with a long ttl (beating seldom) does not stand in for one whose
        -- group's deaths must be told sooner.
        IF own_session AND EXISTS (
                SELECT 1 FROM pgcoord.member_sessions AS o
                WHERE o."group" = grp AND o.left_at IS NULL AND o.id < member_id
                  AND o.heartbeat_at > pg_catalog.clock_timestamp()
                      - (LEAST(o.ttl_ms, own_ttl) / 2) * interval '1 millisecond') THEN
            -- Only a heartbeat written: not worth waiting for a WAL flush (or a
            -- synchronous standby), since a heartbeat lost in a crash is replaced a
            -- third of a ttl later. A sweep's deaths are committed as usual.
            PERFORM pg_catalog.set_config('synchronous_commit', 'off', true);
        ELSE
            PERFORM pgcoord.member_reap_group(grp);
        END IF;
        IF NOT want_state THEN
            RETURN '{}';
        END IF;
        -- The shape of the member_state statement (sql/member_queries.sql), from
        -- the rows alone.
        RETURN pg_catalog.json_build_object(
            'ring', coalesce((SELECT pg_catalog.json_agg(m.id ORDER BY m.id)
                              FROM pgcoord.member_sessions AS m
                              WHERE m.left_at IS NULL AND m.has_session), '[]'),
            'peers', coalesce((
                SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                           'id', m.id, 'name', m.name, 'group', m."group", 'meta', m.meta,
                           'joined_at', pg_catalog.to_char(m.joined_at AT TIME ZONE 'UTC',
                                                           'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
                       ORDER BY m.id)
                FROM pgcoord.member_sessions AS m
                WHERE m."group" = grp AND m.left_at IS NULL
                  AND (m.has_session OR m.heartbeat_at + m.ttl_ms * interval '1 millisecond'
                                        > pg_catalog.clock_timestamp())), '[]'),
            'gone', coalesce((
                SELECT pg_catalog.json_object_agg(g.id, g.left_reason)
                FROM pgcoord.member_sessions AS g
                WHERE g."group" = grp AND g.left_at IS NOT NULL), '{}'))::text;
    END
    $body$;

-- Which process a member lives in (host:pid, as the client says), so that a death can
-- be told together with the deaths of the members that died with it.
ALTER TABLE pgcoord.member_sessions ADD COLUMN client text;

COMMENT ON COLUMN pgcoord.member_sessions.client IS
    'pgcoord: the member''s process (host:pid), as it said when it joined; NULL before 0011.';

-- member_join, and the process the member lives in.
CREATE FUNCTION pgcoord.member_join_from(grp text, member_name text, member_meta jsonb, ttl_ms integer,
                                         app_name text, session boolean, from_client text)
    RETURNS TABLE (id integer, joined_at timestamptz)
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        joined record;
    BEGIN
        SELECT j.id, j.joined_at INTO joined
        FROM pgcoord.member_join(grp, member_name, member_meta, ttl_ms, app_name, session) AS j;
        UPDATE pgcoord.member_sessions AS m SET client = from_client WHERE m.id = joined.id;
        RETURN QUERY SELECT joined.id, joined.joined_at;
    END
    $body$;

-- A watcher's wait for its successor's alive lock and the reap that follows its grant,
-- in one statement on the watcher's session: the news leaves the server without a
-- round trip through the client (which, when a process takes ten members with it, is
-- one of twenty processes waking on the same cores).
--
-- Deaths come together: a process with several members takes them all, and its
-- sessions end one after another over tens of milliseconds. Reaped as each watcher is
-- granted, they were told in several NOTIFYs, each signalling every listening session.
-- So once granted, the statement also waits, for 50 ms at most in all, for the alive
-- locks of the target's live-looking siblings (members of the same process): a process
-- that died is told in one NOTIFY as soon as its last session has ended. A sibling that
-- lives (only the target's session was ended) costs the news those 50 ms. Those locks
-- are transaction locks, gone when the statement ends. Every wait here is in share mode:
-- a member holds its own alive lock exclusively, so a share is granted only once its
-- session has ended, and the watchers of members that died together, each waiting for
-- the others' locks, never wait for one another (in exclusive mode, a sibling's lock
-- granted to its own watcher held every other watcher up to its 50 ms).
--
-- A target already marked gone (by the watcher of a member that died with it) costs no
-- pg_locks read. The target's lock is a session lock, kept when the statement fails
-- after the grant (the watcher lets it go either way). Returns member_reap_dead's
-- [[id, reason], ...].
CREATE FUNCTION pgcoord.member_wait_reap(target integer) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        process text;
        sibling integer;
        saved_lock_timeout text := pg_catalog.current_setting('lock_timeout');
        waited_until timestamptz;
        left_ms integer;
    BEGIN
        PERFORM pg_catalog.pg_advisory_lock_shared(pgcoord.member_alive_ns(), target);
        SELECT m.client INTO process FROM pgcoord.member_sessions AS m
        WHERE m.id = target AND m.left_at IS NULL;
        IF NOT FOUND THEN
            RETURN '[]';  -- told already
        END IF;
        IF process IS NOT NULL THEN
            waited_until := pg_catalog.clock_timestamp() + interval '50 milliseconds';
            FOR sibling IN
                SELECT m.id FROM pgcoord.member_sessions AS m
                WHERE m.client = process AND m.left_at IS NULL AND m.has_session AND m.id <> target
                ORDER BY m.id
            LOOP
                left_ms := ceil(extract(epoch FROM waited_until - pg_catalog.clock_timestamp()) * 1000);
                EXIT WHEN left_ms <= 0;
                BEGIN
                    PERFORM pg_catalog.set_config('lock_timeout', left_ms::text, true);
                    PERFORM pg_catalog.pg_advisory_xact_lock_shared(pgcoord.member_alive_ns(), sibling);
                EXCEPTION WHEN lock_not_available THEN
                    EXIT;  -- a sibling lives: the process did not die with the target
                END;
            END LOOP;
            PERFORM pg_catalog.set_config('lock_timeout', saved_lock_timeout, true);
            IF NOT EXISTS (SELECT 1 FROM pgcoord.member_sessions AS m
                           WHERE m.id = target AND m.left_at IS NULL) THEN
                RETURN '[]';  -- told meanwhile, by a sibling's watcher
            END IF;
        END IF;
        RETURN pgcoord.member_reap_dead();
    END
    $body$;

-- schedule_tick (sql/schedule_queries.sql) for a scheduler that reads it on its member's
-- main session, with a lock_timeout of its own: every statement of the member queues
-- behind it, its heartbeat too (bounded by half a ttl), so it must not wait the
-- session's 500 ms behind a lock an operator or a migration holds on the schedules'
-- tables. A SET clause bounds the relation locks too, which a statement takes before it
-- runs anything of its own. Past the bound the tick is read through the pool instead.
CREATE FUNCTION pgcoord.schedule_tick_read()
    RETURNS TABLE (now timestamptz, epoch bigint, names text[], ats timestamptz[],
                   afters timestamptz[], untils timestamptz[])
    LANGUAGE sql
    SET search_path = pg_catalog, pgcoord, pg_temp
    SET lock_timeout = '100ms'
    AS $body$
        SELECT pg_catalog.clock_timestamp(), e.epoch, o.*
        FROM pgcoord.schedule_epoch AS e
        CROSS JOIN (SELECT pg_catalog.array_agg(o.name ORDER BY o.name, o.at),
                           pg_catalog.array_agg(o.at ORDER BY o.name, o.at),
                           pg_catalog.array_agg(o.slot_after ORDER BY o.name, o.at),
                           pg_catalog.array_agg(o.slot_until ORDER BY o.name, o.at)
                    FROM pgcoord.schedule_owed AS o) AS o
    $body$;

COMMENT ON FUNCTION pgcoord.member_beat(integer, boolean) IS
    'pgcoord: a member''s heartbeat; its group''s sweep when it is the sweeper; the group as seen from the rows (JSON) when asked.';
