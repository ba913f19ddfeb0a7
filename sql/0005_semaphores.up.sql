-- pgcoord 0005: semaphores, at most N holders across the fleet (DESIGN §8).
-- Executed verbatim by migrations/versions/0005_semaphores.py.
-- Avoid percent signs and colon-prefixed words: drivers treat them as placeholders.
--
-- A semaphore `name` with limit N is N *lanes*: the two-int advisory locks
-- (k, 0) .. (k, N-1), k = pgcoord.semaphore_key(name). A holder holds one lane
-- (pg_try_advisory_xact_lock for pgcoord.semaphore(), pg_try_advisory_lock for
-- holder.semaphore()), so the server itself never lets more than N sessions in
-- and releases a crashed holder's lane with its session. A session can queue on
-- one lock only, so nobody *waits* for a lane in the server: a waiter LISTENs on
-- channel pgcoord_semaphores, tries again on each notification whose payload
-- is k, and each release sends one. While it waits it holds the shared lock
-- (k, -1), the *waiting room*, so that pgcoord.holders can show it.
--
-- Two names whose keys collide share lanes: each still admits at most its own
-- limit (its holders hold lanes below it), but may wait for lanes the other
-- holds. A collision can lower concurrency, never raise it.

CREATE TABLE pgcoord.semaphores (
    name       text PRIMARY KEY,
    key        integer NOT NULL,
    "limit"    integer NOT NULL CHECK ("limit" > 0),
    updated_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);

CREATE INDEX semaphores_key ON pgcoord.semaphores (key);

COMMENT ON TABLE pgcoord.semaphores IS
    'pgcoord semaphore names by key, recorded once per process and name, so pgcoord.holders can name lanes.';

-- The high 32 bits of lock_key(name), signed; the one value that is the member
-- alive-lock namespace (pgcoord.member_alive_ns()) is moved next to it, so a
-- member's alive lock is never mistaken for a lane. Same as pgcoord's
-- semaphore_key() in Python. Stable forever.
CREATE FUNCTION pgcoord.semaphore_key(name text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN (SELECT CASE WHEN h.k = 1885823853 THEN 1885823852 ELSE h.k END
            FROM (SELECT (pgcoord.lock_key(name) >> 32)::integer AS k) AS h);

COMMENT ON FUNCTION pgcoord.semaphore_key(text) IS
    'Lane namespace (classid) of a pgcoord semaphore: the high 32 bits of lock_key(name), signed.';

-- The lanes (sem_key, lane) this session holds or awaits: a session lock is
-- re-entrant, so a session must never count a lane it already holds as a new one.
CREATE FUNCTION pgcoord.semaphore_own_lanes(sem_key integer) RETURNS integer[]
    LANGUAGE sql VOLATILE
    AS $body$
        SELECT pg_catalog.array_agg(l.objid::bigint::integer)
        FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.objsubid = 2
          AND l.pid = pg_catalog.pg_backend_pid()
          AND l.classid = (sem_key::bigint & 4294967295)::oid
          AND l.objid <> 4294967295::oid
    $body$;

-- Take one free lane of (sem_key, 0 .. sem_limit-1), trying from a random one
-- so holders spread over the lanes; the lane, or NULL when all are taken.
-- session_scope picks pg_try_advisory_lock over pg_try_advisory_xact_lock.
-- Lanes in `skip` are not tried (the caller already holds them).
CREATE FUNCTION pgcoord.semaphore_try(
    sem_key integer, sem_limit integer, session_scope boolean, skip integer[] DEFAULT NULL
) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $body$
DECLARE
    start integer := pg_catalog.floor(pg_catalog.random() * sem_limit)::integer;
    lane integer;
BEGIN
    FOR i IN 0 .. sem_limit - 1 LOOP
        lane := pg_catalog.mod(start + i, sem_limit);
        CONTINUE WHEN skip IS NOT NULL AND lane = ANY (skip);
        IF session_scope THEN
            IF pg_catalog.pg_try_advisory_lock(sem_key, lane) THEN
                RETURN lane;
            END IF;
        ELSIF pg_catalog.pg_try_advisory_xact_lock(sem_key, lane) THEN
            RETURN lane;
        END IF;
    END LOOP;
    RETURN NULL;
END
$body$;

-- pgcoord.semaphore()'s acquire, sent together with BEGIN: a lane for this
-- transaction, or SQLSTATE PC001 (so that the message fails as a whole and the
-- client sees "busy"). With `notify` it also queues the release's notification
-- (delivered at commit, when the lane is released): only for a transaction of
-- the caller's own, whose commit pgcoord does not see. A commit that NOTIFYs
-- takes a database-wide lock, one committer at a time, so for its own
-- transactions pgcoord instead wakes waiters after the commit, and only when
-- someone is in the waiting room (semaphore_wake). When the lanes in
-- `skip` (this session's own) are already every lane below sem_limit, SQLSTATE
-- PC005: only this transaction could free one, so waiting would never end.
CREATE FUNCTION pgcoord.semaphore_take_xact(
    sem_key integer, sem_limit integer, skip integer[] DEFAULT NULL, notify boolean DEFAULT true
) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $body$
DECLARE
    lane integer := pgcoord.semaphore_try(sem_key, sem_limit, false, skip);
BEGIN
    IF lane IS NULL AND skip IS NOT NULL
       AND (SELECT pg_catalog.count(*) FROM pg_catalog.unnest(skip) AS s(l)
            WHERE s.l >= 0 AND s.l < sem_limit) >= sem_limit THEN
        RAISE EXCEPTION USING ERRCODE = 'PC005',
            MESSAGE = 'pgcoord: this transaction already holds every lane of semaphore ' || sem_key;
    END IF;
    IF lane IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PC001',
            MESSAGE = 'pgcoord: every lane of semaphore ' || sem_key || ' is taken';
    END IF;
    IF notify THEN
        PERFORM pg_catalog.pg_notify('pgcoord_semaphores', sem_key::text);
    END IF;
    RETURN lane;
END
$body$;

-- A waiter's try, outside any transaction: the first call (enter) also takes
-- the waiting room (sem_key, -1). A lane is taken at session level, so it cannot
-- be lost between this statement and the transaction that takes it over
-- (semaphore_adopt_xact). When it gets one it also leaves the waiting room and
-- stops listening (this statement commits by itself, so the UNLISTEN holds).
CREATE FUNCTION pgcoord.semaphore_wait_try(
    sem_key integer, sem_limit integer, enter boolean, skip integer[] DEFAULT NULL
) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $body$
DECLARE
    lane integer;
BEGIN
    IF enter THEN
        PERFORM pg_catalog.pg_advisory_lock_shared(sem_key, -1);
    END IF;
    lane := pgcoord.semaphore_try(sem_key, sem_limit, true, skip);
    IF lane IS NOT NULL THEN
        PERFORM pg_catalog.pg_advisory_unlock_shared(sem_key, -1);
        UNLISTEN pgcoord_semaphores;
    END IF;
    RETURN lane;
END
$body$;

-- Turn the session-level lane a waiter got into this transaction's lane (the
-- same session takes it again at once, then lets go of the session level).
-- pgcoord wakes the next waiter after this transaction (semaphore_wake).
-- Only a try: a session never conflicts with its own lock, so the take
-- succeeds whenever the session holds the lane; if it does not (and another
-- session does) this fails at once rather than queueing with no deadline.
CREATE FUNCTION pgcoord.semaphore_adopt_xact(sem_key integer, lane integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $body$
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(sem_key, lane)
       OR NOT pg_catalog.pg_advisory_unlock(sem_key, lane) THEN
        RAISE EXCEPTION USING
            MESSAGE = 'pgcoord: lane ' || lane || ' of semaphore ' || sem_key || ' was not held';
    END IF;
    RETURN lane;
END
$body$;

-- Tell the waiters of sem_key that a lane was freed (run after the lane is
-- free: after the commit or rollback that ended its transaction, or after the
-- unlock in the same statement). With nobody in the waiting room there is
-- nobody to tell, and a NOTIFY costs every listener a wake-up and its commit a
-- database-wide lock: the room is empty when its exclusive try succeeds. A
-- waiter enters the room before its first try, in the same statement, so a
-- waiter missed here tried after the lane was freed and saw it free.
CREATE FUNCTION pgcoord.semaphore_wake(sem_key integer) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $body$
BEGIN
    IF pg_catalog.pg_try_advisory_lock(sem_key, -1) THEN
        PERFORM pg_catalog.pg_advisory_unlock(sem_key, -1);
        RETURN false;
    END IF;
    PERFORM pg_catalog.pg_notify('pgcoord_semaphores', sem_key::text);
    RETURN true;
END
$body$;

-- Release a session-level lane and tell the waiters, in one statement (the
-- unlock is immediate; the notification goes at the end of the statement).
CREATE FUNCTION pgcoord.semaphore_release(sem_key integer, lane integer) RETURNS boolean
    LANGUAGE plpgsql VOLATILE
    AS $body$
DECLARE
    released boolean := pg_catalog.pg_advisory_unlock(sem_key, lane);
BEGIN
    PERFORM pgcoord.semaphore_wake(sem_key);
    RETURN released;
END
$body$;

-- A waiter gives up (timeout, cancellation, failure): stop listening, let go of
-- the waiting room and of any lane of sem_key this session holds at session
-- level (a try cancelled in flight may have got one unseen), and tell the
-- others if a lane was freed. What is held is read from pg_locks: unlocking a
-- lock not held warns. Only for connections pgcoord waits on, which hold no
-- session-level lane of sem_key for anyone else.
CREATE FUNCTION pgcoord.semaphore_wait_abandon(sem_key integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    AS $body$
DECLARE
    freed integer := 0;
    held record;
BEGIN
    UNLISTEN pgcoord_semaphores;
    -- Unlocking a lock not held warns; pg_locks says what is held.
    WHILE EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
          AND l.objsubid = 2 AND l.classid = (sem_key::bigint & 4294967295)::oid
          AND l.objid = 4294967295::oid AND l.mode = 'ShareLock'
    ) LOOP
        PERFORM pg_catalog.pg_advisory_unlock_shared(sem_key, -1);
    END LOOP;
    FOR held IN
        SELECT l.objid::bigint::integer AS lane
        FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
          AND l.objsubid = 2 AND l.classid = (sem_key::bigint & 4294967295)::oid
          AND l.objid <> 4294967295::oid AND l.mode = 'ExclusiveLock'
    LOOP
        WHILE EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
              AND l.objsubid = 2 AND l.classid = (sem_key::bigint & 4294967295)::oid
              AND l.objid = held.lane::oid AND l.mode = 'ExclusiveLock'
        ) LOOP
            PERFORM pg_catalog.pg_advisory_unlock(sem_key, held.lane);
            freed := freed + 1;
        END LOOP;
    END LOOP;
    IF freed > 0 THEN
        PERFORM pg_catalog.pg_notify('pgcoord_semaphores', sem_key::text);
    END IF;
    RETURN freed;
END
$body$;

CREATE OR REPLACE VIEW pgcoord.holders AS
WITH sem AS MATERIALIZED (
    -- Registered semaphore keys as pg_locks shows them (classid is an unsigned
    -- oid); names that collide on a key are listed together.
    SELECT (s.key::bigint & 4294967295)::oid AS classid, s.key,
           pg_catalog.string_agg(s.name, ' | ' ORDER BY s.name) AS name
    FROM pgcoord.semaphores AS s
    GROUP BY s.key
)
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
    ms.name                                            AS member,
    NULL::integer                                      AS lane
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
  AND NOT (l.objsubid = 2 AND l.classid IN (SELECT sem.classid FROM sem))
UNION ALL
-- A granted lane is a holder; the waiting room (lane -1) holds the waiters,
-- shown as not granted. A waiter's `since` is NULL: nothing in the server
-- records when its wait began (each retry is a new statement, so its session's
-- state_change would always look under 0.5 s old).
SELECT
    'semaphore'::text, sem.name, sem.key::bigint,
    coalesce(nullif(a.application_name, ''), 'pid ' || l.pid::text), l.pid,
    a.application_name, a.client_addr,
    (l.objid <> 4294967295::oid),
    CASE WHEN l.objid <> 4294967295::oid THEN coalesce(a.xact_start, a.backend_start) END,
    NULL::timestamptz, NULL::bigint, NULL::integer[], false, (a.pid IS NOT NULL), ms.name,
    CASE WHEN l.objid <> 4294967295::oid THEN l.objid::bigint::integer END
FROM pg_catalog.pg_locks AS l
JOIN sem ON sem.classid = l.classid
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.member_sessions AS ms ON ms.pid = l.pid AND ms.left_at IS NULL
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())
UNION ALL
SELECT
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid) END,
    ms.name, NULL::integer
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
    ms.name, NULL::integer
FROM pgcoord.job_slots AS j
LEFT JOIN pgcoord.member_sessions AS ms
       ON j.runner = ms.name || '/' || ms.id::text AND ms.left_at IS NULL
WHERE j.state = 'running';
