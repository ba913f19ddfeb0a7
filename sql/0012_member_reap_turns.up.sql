-- pgcoord 0012: members are marked gone by one reaper at a time.
--
-- When a process takes several members with it, several watchers are granted at once
-- (and a heartbeat's sweep, or a join, may reap too). Each marked the dead rows in the
-- order of its own plan: a sequential scan in heap order, an index scan by name or by
-- id. Two reapers in crossed orders deadlocked, and the server found the deadlock only
-- after deadlock_timeout (1 s by default): the crash was told a second or two late
-- (the crash-news benchmark, 200 members, about one round in fifty;
-- tests/integration/test_member_reap_turns.py crosses the orders on purpose).
--
-- Every function that marks a member gone now first takes one transaction lock, so
-- reapers take turns. A reaper's turn lasts one short statement; the next one finds the
-- rows marked already, and tells nothing twice.

-- The reapers' turn: a transaction lock, taken before any member row is locked.
CREATE FUNCTION pgcoord.member_reap_turn() RETURNS void
    LANGUAGE sql
    RETURN pg_catalog.pg_advisory_xact_lock(pgcoord.lock_key('pgcoord.member_reap'));

CREATE OR REPLACE FUNCTION pgcoord.member_mark_gone(member_id integer, reason text) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        grp text;
        why text;
    BEGIN
        PERFORM pgcoord.member_reap_turn();
        UPDATE pgcoord.member_sessions AS m
        SET left_at = pg_catalog.clock_timestamp(),
            left_reason = coalesce(reason, pgcoord.member_left_reason(m.heartbeat_at, m.ttl_ms))
        WHERE m.id = member_id AND m.left_at IS NULL
        RETURNING m."group", m.left_reason INTO grp, why;
        IF grp IS NULL THEN
            RETURN NULL;
        END IF;
        PERFORM pgcoord.member_notify('left', grp, member_id, why);
        RETURN why;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.member_reap_dead() RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        chunk record;
        marked jsonb := '[]'::jsonb;
    BEGIN
        -- Before the statement below: its reading of pg_locks then comes after the
        -- previous reaper's commit.
        PERFORM pgcoord.member_reap_turn();
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
