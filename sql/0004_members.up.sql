-- pgcoord 0004: members, a process's presence in the database (DESIGN §6).
-- Executed verbatim by migrations/versions/0004_members.py.
--
-- A member is one dedicated session. While it lives it holds its *alive lock*,
-- the two-int advisory lock (1885823853, id) (1885823853 is 'pgcm' in ASCII; the
-- two-int form has objsubid 2, so it can never collide with a bigint key). A
-- row whose alive lock is not held by the session that wrote it (its pid) is a
-- dead member, whatever the row says: rows are bookkeeping, pg_locks is truth.

CREATE SEQUENCE pgcoord.member_ids AS integer MINVALUE 1 CYCLE;

CREATE TABLE pgcoord.member_sessions (
    id               integer PRIMARY KEY,
    "group"          text NOT NULL,
    name             text NOT NULL,
    meta             jsonb NOT NULL DEFAULT '{}'::jsonb,
    pid              integer NOT NULL,         -- backend pid of the member's main session
    application_name text,
    joined_at        timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    heartbeat_at     timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp(),
    ttl_ms           integer NOT NULL,
    -- false behind a transaction-mode pooler: no alive lock, liveness by heartbeat.
    has_session      boolean NOT NULL DEFAULT true,
    -- Set when the member is known gone; the row stays a while as a tombstone so
    -- that members polling behind a pooler (no NOTIFY) learn why it left.
    left_at          timestamptz,
    left_reason      text CHECK (left_reason IN ('left', 'crashed', 'silent'))
);

-- Names are unique among live members only.
CREATE UNIQUE INDEX member_sessions_live_name ON pgcoord.member_sessions ("group", name)
    WHERE left_at IS NULL;

COMMENT ON TABLE pgcoord.member_sessions IS
    'pgcoord members: bookkeeping rows; pgcoord.members shows the live ones.';

CREATE FUNCTION pgcoord.member_alive_ns() RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE
    RETURN 1885823853;

-- The members whose own session holds their alive lock right now: one snapshot
-- of pg_locks (each read of pg_locks copies the whole lock table, so callers
-- read it once per statement, not once per row).
CREATE FUNCTION pgcoord.member_sessions_alive() RETURNS TABLE (id integer, pid integer)
    LANGUAGE sql STABLE
    AS $body$
        SELECT l.objid::bigint::integer, l.pid
        FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = pgcoord.member_alive_ns()::oid
          AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                            WHERE d.datname = pg_catalog.current_database())
    $body$;

-- Live rows: a member with a session whose session holds its lock, or a member
-- without a session (behind a transaction-mode pooler) whose heartbeat is
-- younger than its ttl.
CREATE VIEW pgcoord.members AS
WITH alive AS MATERIALIZED (SELECT * FROM pgcoord.member_sessions_alive())
SELECT m.id, m."group", m.name, m.meta, m.pid, m.application_name, m.joined_at,
       m.heartbeat_at, m.has_session
FROM pgcoord.member_sessions AS m
WHERE m.left_at IS NULL
  AND CASE WHEN m.has_session
           THEN EXISTS (SELECT 1 FROM alive AS a WHERE a.id = m.id AND a.pid = m.pid)
           ELSE m.heartbeat_at + m.ttl_ms * interval '1 millisecond' > pg_catalog.clock_timestamp()
      END;

COMMENT ON VIEW pgcoord.members IS 'pgcoord: live members, one row per process presence.';

-- Why a member left, told from the age of its last heartbeat when found dead: a
-- member that stopped heartbeating for half its ttl was silent (paused, cut
-- off) before its session ended; otherwise it crashed.
CREATE FUNCTION pgcoord.member_left_reason(heartbeat timestamptz, ttl_ms integer) RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN pg_catalog.clock_timestamp() - heartbeat > (ttl_ms / 2) * interval '1 millisecond'
                THEN 'silent' ELSE 'crashed' END;

-- Every membership change is told on one channel; the payload says which group.
CREATE FUNCTION pgcoord.member_notify(ev text, grp text, member_id integer, reason text)
    RETURNS void
    LANGUAGE sql
    AS $body$
        SELECT pg_catalog.pg_notify('pgcoord_members',
            pg_catalog.json_build_object('ev', ev, 'group', grp, 'id', member_id,
                                         'reason', reason)::text)
    $body$;

-- Mark member_id gone (once) and announce it; the reason, or NULL if it was
-- already marked.
CREATE FUNCTION pgcoord.member_mark_gone(member_id integer, reason text) RETURNS text
    LANGUAGE plpgsql
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

-- Mark the dead members of a group gone (and announce each), and forget
-- tombstones older than a minute. Returns how many were found dead.
CREATE FUNCTION pgcoord.member_reap_group(grp text) RETURNS integer
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        dead integer;
        n integer := 0;
    BEGIN
        FOR dead IN
            SELECT m.id FROM pgcoord.member_sessions AS m
            WHERE m."group" = grp AND m.left_at IS NULL
              AND m.id NOT IN (SELECT v.id FROM pgcoord.members AS v WHERE v."group" = grp)
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

-- Join: take the alive lock, then write the row, so that nobody can see the
-- row of a live member without its lock. The lock is a session lock: a failed
-- insert gives it back by hand, since a rollback does not.
CREATE FUNCTION pgcoord.member_join(grp text, member_name text, member_meta jsonb, ttl_ms integer,
                                    app_name text, session boolean)
    RETURNS TABLE (id integer, joined_at timestamptz)
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        new_id integer := pg_catalog.nextval('pgcoord.member_ids');
    BEGIN
        PERFORM pgcoord.member_reap_group(grp);
        IF session THEN
            PERFORM pg_catalog.pg_advisory_lock(pgcoord.member_alive_ns(), new_id);
        END IF;
        -- An id is reused only after the sequence wraps, or after a crash lost
        -- its last values: any row that has it belongs to a dead member.
        PERFORM pgcoord.member_mark_gone(new_id, NULL);
        DELETE FROM pgcoord.member_sessions AS m WHERE m.id = new_id;
        BEGIN
            INSERT INTO pgcoord.member_sessions AS m
                (id, "group", name, meta, pid, application_name, ttl_ms, has_session)
            VALUES (new_id, grp, member_name, coalesce(member_meta, '{}'::jsonb),
                    pg_catalog.pg_backend_pid(), app_name, ttl_ms, session);
        EXCEPTION WHEN unique_violation THEN
            IF session THEN
                PERFORM pg_catalog.pg_advisory_unlock(pgcoord.member_alive_ns(), new_id);
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'PC003',
                MESSAGE = 'pgcoord: a live member of group ' || grp || ' is already named ' || member_name;
        END;
        PERFORM pgcoord.member_notify('joined', grp, new_id, NULL);
        RETURN QUERY SELECT new_id, pg_catalog.clock_timestamp();
    END
    $body$;

-- Leave: the row is marked and announced, then the alive lock let go at once
-- rather than when the server notices the closed socket.
CREATE FUNCTION pgcoord.member_leave(member_id integer) RETURNS boolean
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        PERFORM pgcoord.member_mark_gone(member_id, 'left');
        PERFORM pg_catalog.pg_advisory_unlock(pgcoord.member_alive_ns(), member_id);
        RETURN true;
    END
    $body$;

-- A watcher that was granted member_id's alive lock knows it is dead: mark and
-- announce it, once. Returns why it left, or NULL when it was already marked
-- (it said goodbye, or another member told its death first).
CREATE FUNCTION pgcoord.member_reap(member_id integer) RETURNS text
    LANGUAGE sql
    RETURN pgcoord.member_mark_gone(member_id, NULL);

-- A live member's heartbeat: keeps its session from idle_session_timeout, keeps
-- a sessionless member alive, and sweeps its group for members nobody woke for
-- (a watcher that was paused itself when its target died). False when this
-- member's own row is gone: it was declared dead and must join again.
CREATE FUNCTION pgcoord.member_heartbeat(member_id integer) RETURNS boolean
    LANGUAGE plpgsql
    AS $body$
    DECLARE
        grp text;
    BEGIN
        UPDATE pgcoord.member_sessions SET heartbeat_at = pg_catalog.clock_timestamp()
        WHERE id = member_id AND left_at IS NULL RETURNING "group" INTO grp;
        IF grp IS NULL THEN
            RETURN false;
        END IF;
        PERFORM pgcoord.member_reap_group(grp);
        RETURN true;
    END
    $body$;
