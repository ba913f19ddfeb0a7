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
-- (younger than half their ttl). If it stops beating, the next one sweeps within a
-- half ttl. The group read without pg_locks may list a dead member not yet swept: in
-- the ring, its watcher is granted its lock at once and reaps it.

CREATE FUNCTION pgcoord.member_beat(member_id integer, want_state boolean) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        grp text;
    BEGIN
        UPDATE pgcoord.member_sessions SET heartbeat_at = pg_catalog.clock_timestamp()
        WHERE id = member_id AND left_at IS NULL RETURNING "group" INTO grp;
        IF grp IS NULL THEN
            RETURN NULL;  -- declared dead: the member joins again
        END IF;
        IF EXISTS (SELECT 1 FROM pgcoord.member_sessions AS o
                   WHERE o."group" = grp AND o.left_at IS NULL AND o.id < member_id
                     AND o.heartbeat_at > pg_catalog.clock_timestamp()
                                          - (o.ttl_ms / 2) * interval '1 millisecond') THEN
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

-- A watcher's wait for its successor's alive lock and the reap that follows its grant,
-- in one statement on the watcher's session: the news leaves the server without a
-- round trip through the client (which, when a process takes ten members with it, is
-- one of twenty processes waking on the same cores). A target already marked gone (by
-- the watcher of a member that died with it) costs no pg_locks read. The lock is a
-- session lock, kept when the statement fails after the grant (the watcher lets it go
-- either way). Returns member_reap_dead's [[id, reason], ...].
CREATE FUNCTION pgcoord.member_wait_reap(target integer) RETURNS text
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    BEGIN
        PERFORM pg_catalog.pg_advisory_lock(pgcoord.member_alive_ns(), target);
        IF NOT EXISTS (SELECT 1 FROM pgcoord.member_sessions AS m
                       WHERE m.id = target AND m.left_at IS NULL) THEN
            RETURN '[]';
        END IF;
        RETURN pgcoord.member_reap_dead();
    END
    $body$;

COMMENT ON FUNCTION pgcoord.member_beat(integer, boolean) IS
    'pgcoord: a member''s heartbeat; its group''s sweep when it is the sweeper; the group as seen from the rows (JSON) when asked.';
