-- pgcoord 0012 down: reapers mark members gone without taking turns again.

CREATE OR REPLACE FUNCTION pgcoord.member_mark_gone(member_id integer, reason text) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        grp text;
        why text;
    BEGIN
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

DROP FUNCTION pgcoord.member_reap_turn();
