-- pgcoord 0012: every reaper marks the dead in the same order (by id), and a heartbeat
-- is not undone by its sweep.
--
-- When a process takes several members with it, several watchers are granted at once,
-- and each reaps (a heartbeat's sweep may too). Each marked the dead rows in the order
-- of its own plan: a sequential scan in heap order, an index scan by name. Two reapers
-- in crossed orders deadlocked, and the server breaks a deadlock only after
-- deadlock_timeout (1 s by default): the crash was told a second or two late (the
-- crash-news benchmark, 200 members, about one round in fifty;
-- tests/integration/test_member_reap_order.py crosses the orders on purpose). Now
-- member_reap_dead locks the rows it marks in id order before marking them, and a
-- sweep (member_reap_group) marks them in id order: a reaper waits for another only on
-- a row the other holds, and holds none above it meanwhile. A goodbye or a join marks
-- one row by its key, and waits for nobody else's order.
--
-- A sweep that cannot lock a dead row (held by an operator past lock_timeout, or a
-- deadlock with a sessionless member's own beat) used to roll back the whole heartbeat,
-- after up to the main session's 500 ms: a member with a short ttl lost its session to
-- its own sweep's wait. The sweep now gives up after 100 ms, and only the sweep.

CREATE OR REPLACE FUNCTION pgcoord.member_reap_dead() RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        chunk record;
        marked jsonb := '[]'::jsonb;
    BEGIN
        FOR chunk IN
            WITH alive AS MATERIALIZED (SELECT a.id, a.pid FROM pgcoord.member_sessions_alive() AS a),
            -- Locked in id order, as every reaper locks them, before they are marked:
            -- the UPDATE's own plan (a sequential scan, an index scan by name) would
            -- lock them in its own order.
            doomed AS MATERIALIZED (
                SELECT m.id FROM pgcoord.member_sessions AS m
                 WHERE m.left_at IS NULL AND m.has_session
                   AND NOT EXISTS (SELECT 1 FROM alive AS a WHERE a.id = m.id AND a.pid = m.pid)
                 ORDER BY m.id
                   FOR UPDATE OF m
            ),
            gone AS (
                UPDATE pgcoord.member_sessions AS m
                   SET left_at = pg_catalog.clock_timestamp(),
                       left_reason = pgcoord.member_left_reason(m.heartbeat_at, m.ttl_ms)
                  FROM doomed AS d
                 WHERE m.id = d.id AND m.left_at IS NULL
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

CREATE OR REPLACE FUNCTION pgcoord.member_reap_group(grp text) RETURNS integer
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        dead integer;
        n integer := 0;
    BEGIN
        -- Locked in id order, as every reaper locks the rows it marks. A row updated
        -- while we waited for it is judged again on its new version: a sessionless
        -- member whose beat came meanwhile is alive (the list of live members below
        -- is read once, before).
        FOR dead IN
            SELECT m.id FROM pgcoord.member_sessions AS m
            WHERE m."group" = grp AND m.left_at IS NULL
              AND m.id NOT IN (SELECT v.id FROM pgcoord.members AS v WHERE v."group" = grp)
              AND (m.has_session
                   OR m.heartbeat_at + m.ttl_ms * interval '1 millisecond' <= pg_catalog.clock_timestamp())
            ORDER BY m.id
            FOR UPDATE OF m
        LOOP
            IF pgcoord.member_mark_gone(dead, NULL) IS NOT NULL THEN
                n := n + 1;
            END IF;
        END LOOP;
        DELETE FROM pgcoord.member_sessions AS m
        WHERE m."group" = grp AND m.left_at < pg_catalog.clock_timestamp() - interval '1 minute';
        RETURN n;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.member_beat(member_id integer, want_state boolean) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        grp text;
        own_ttl integer;
        own_session boolean;
        saved_lock_timeout text;
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
            -- The sweep may wait for a dead row someone else holds (an operator's
            -- transaction; a deadlock with a sessionless member's beat): then only the
            -- sweep is undone, after 100 ms at most (a reaper holds the rows it marks
            -- for milliseconds). The beat stands, well inside its own bound of half a
            -- ttl, and the next one sweeps again.
            saved_lock_timeout := pg_catalog.current_setting('lock_timeout');
            PERFORM pg_catalog.set_config('lock_timeout', '100ms', true);
            BEGIN
                PERFORM pgcoord.member_reap_group(grp);
            EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
                NULL;
            END;
            PERFORM pg_catalog.set_config('lock_timeout', saved_lock_timeout, true);
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
