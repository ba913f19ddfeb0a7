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

-- Lease news for electors and observers: every change of holder (an acquisition,
-- a takeover, a release) and every resign request is told on one channel, from
-- a trigger so that no path that writes a lease can forget to.
ALTER TABLE pgcoord.leases ADD COLUMN resign_requested_at timestamptz;

CREATE FUNCTION pgcoord.lease_news() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
    BEGIN
        IF TG_OP = 'UPDATE' AND NEW.fence IS DISTINCT FROM OLD.fence THEN
            NEW.resign_requested_at := NULL;   -- a request is for the term it was made in
        END IF;
        IF TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence
           OR NEW.holder IS DISTINCT FROM OLD.holder THEN
            PERFORM pg_catalog.pg_notify('pgcoord_leases', pg_catalog.json_build_object(
                'ev', CASE WHEN NEW.holder IS NULL THEN 'released' ELSE 'acquired' END,
                'name', NEW.name, 'holder', NEW.holder, 'fence', NEW.fence)::text);
        ELSIF NEW.resign_requested_at IS NOT NULL AND OLD.resign_requested_at IS NULL THEN
            PERFORM pg_catalog.pg_notify('pgcoord_leases', pg_catalog.json_build_object(
                'ev', 'resign', 'name', NEW.name, 'holder', NEW.holder, 'fence', NEW.fence)::text);
        END IF;
        RETURN NEW;
    END
    $body$;

CREATE TRIGGER lease_news BEFORE INSERT OR UPDATE ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.lease_news();

-- Ask the current holder of a lease to step down gracefully (deploys). True when
-- there was a live holder to ask. An elector sees the request at once (NOTIFY)
-- or at its next renewal.
CREATE FUNCTION pgcoord.request_resign(lease_name text) RETURNS boolean
    LANGUAGE sql
    AS $body$
        WITH asked AS (
            UPDATE pgcoord.leases AS l
               SET resign_requested_at = coalesce(l.resign_requested_at, pg_catalog.clock_timestamp())
             WHERE l.name = lease_name AND l.holder IS NOT NULL
               AND l.expires_at > pg_catalog.clock_timestamp()
            RETURNING 1
        )
        SELECT EXISTS (SELECT 1 FROM asked)
    $body$;

-- lease_renew that also says whether a resign was requested for this term.
CREATE FUNCTION pgcoord.lease_renew_asking(
    lease_name text, lease_holder text, lease_fence bigint, ttl_ms bigint
) RETURNS TABLE (expires_at timestamptz, resign boolean)
    LANGUAGE sql
    AS $body$
        UPDATE pgcoord.leases AS l
           SET renewed_at = pg_catalog.clock_timestamp(),
               expires_at = pg_catalog.clock_timestamp() + ttl_ms * interval '1 millisecond'
         WHERE l.name = lease_name AND l.holder = lease_holder AND l.fence = lease_fence
           AND l.expires_at > pg_catalog.clock_timestamp()
        RETURNING l.expires_at, l.resign_requested_at IS NOT NULL
    $body$;

-- Job claims tied to a member: a scheduler with a member runs its slots as
-- runner '<member name>/<member id>'. When that member is gone (its tombstone,
-- kept a minute, says so and gives its exact runner name) its running claims
-- expire now, so the next tick abandons or retries them (per the job's
-- on_crash) instead of after the claim's ttl. Returns how many.
CREATE FUNCTION pgcoord.job_expire_member_claims(member_id integer) RETURNS integer
    LANGUAGE sql
    AS $body$
        WITH expired AS (
            UPDATE pgcoord.job_slots AS s
               SET claim_expires_at = pg_catalog.clock_timestamp()
             WHERE s.state = 'running'
               AND s.runner = (SELECT m.name || '/' || m.id::text FROM pgcoord.member_sessions AS m
                               WHERE m.id = member_id AND m.left_at IS NOT NULL)
               AND s.claim_expires_at > pg_catalog.clock_timestamp()
            RETURNING 1
        )
        SELECT count(*)::integer FROM expired
    $body$;

-- The view names the member behind each row (advisory locks and leases held on
-- a member's session, job slots run under a member), in a new last column.
CREATE OR REPLACE VIEW pgcoord.holders AS
SELECT
    'advisory'::text                                   AS kind,
    n.name                                             AS name,
    k.key                                              AS key,
    coalesce(nullif(a.application_name, ''), 'pid ' || l.pid::text) AS holder,
    l.pid                                              AS pid,
    a.application_name                                 AS application_name,
    a.client_addr                                      AS client_addr,
    l.granted                                          AS granted,
    CASE WHEN l.granted THEN coalesce(a.xact_start, a.backend_start)
         ELSE l.waitstart END                          AS since,
    NULL::timestamptz                                  AS expires_at,
    NULL::bigint                                       AS fence,
    CASE WHEN l.granted THEN NULL::integer[]
         ELSE pg_catalog.pg_blocking_pids(l.pid) END   AS blocked_by,
    (l.mode = 'ShareLock')                             AS shared,
    (a.pid IS NOT NULL)                                AS session_alive,
    ms.name                                            AS member
FROM pg_catalog.pg_locks AS l
CROSS JOIN LATERAL (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
) AS k
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = k.key AND l.objsubid = 1
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = l.pid AND ms.left_at IS NULL
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
UNION ALL
SELECT
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid) END,
    ms.name
FROM pgcoord.leases AS s
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = s.holder_pid
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = s.holder_pid AND ms.left_at IS NULL
WHERE s.holder IS NOT NULL AND s.expires_at > pg_catalog.clock_timestamp()
UNION ALL
SELECT
    'job'::text, j.job || ' @ ' || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS'),
    NULL::bigint, j.runner, NULL::integer, NULL::text, NULL::inet, true, j.started_at,
    j.claim_expires_at, j.attempt::bigint, NULL::integer[], false,
    (j.claim_expires_at > pg_catalog.clock_timestamp()),
    ms.name
FROM pgcoord.job_slots AS j
LEFT JOIN pgcoord.member_sessions AS ms
       ON j.runner = ms.name || '/' || ms.id::text AND ms.left_at IS NULL
WHERE j.state = 'running';

-- Tie a lease just taken to the taker's session (its doorbell now held there):
-- for a takeover that raced the old holder's exit, taken before the bell was free.
CREATE FUNCTION pgcoord.lease_bind_session(
    lease_name text, lease_holder text, lease_fence bigint, session_pid integer
) RETURNS boolean
    LANGUAGE sql
    AS $body$
        WITH bound AS (
            UPDATE pgcoord.leases AS l SET holder_pid = session_pid
             WHERE l.name = lease_name AND l.holder = lease_holder AND l.fence = lease_fence
               AND l.expires_at > pg_catalog.clock_timestamp()
            RETURNING 1
        )
        SELECT EXISTS (SELECT 1 FROM bound)
    $body$;
