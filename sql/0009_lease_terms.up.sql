-- pgcoord 0009: the history of leadership (pgcoord.lease_terms), and names for every
-- lock pgcoord.holders shows. Executed verbatim by migrations/versions/0009_lease_terms.py.
-- Avoid percent signs and colon-prefixed words: drivers treat them as placeholders.
--
-- A *term* is one holding of a lease: from the change of holder that gave the row
-- its fence, to whatever ended it. pgcoord.leases keeps only the current term;
-- this table keeps the last ones of each name, written by triggers on
-- pgcoord.leases, so that every path that changes a lease row (lease_acquire,
-- lease_release, partition claims and releases, pgcoord.testing, SQL by hand) is
-- recorded, and none can forget to. docs/leases.md, "Leadership history", says
-- what each ended_how means.

CREATE TABLE pgcoord.lease_terms (
    name        text        NOT NULL,   -- the lease/election name (pgcoord.leases.name)
    fence       bigint      NOT NULL,   -- the term's fence
    holder      text        NOT NULL,   -- the holder's name as in pgcoord.leases.holder
    holder_pid  integer,                -- backend pid when known (elector/member leases)
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz,            -- NULL while the term runs
    ended_how   text CHECK (ended_how IN ('released','expired','session_ended','taken_over')),
    -- Set when a resign was asked for (pgcoord.request_resign) during this term:
    -- 'released' with it set is a leader that stepped down when asked.
    resign_requested_at timestamptz,
    PRIMARY KEY (name, fence),
    CHECK ((ended_at IS NULL) = (ended_how IS NULL))
);

COMMENT ON TABLE pgcoord.lease_terms IS
    'pgcoord: the last terms of each lease (who held it, when, its fence, how it ended), written by triggers on pgcoord.leases, pruned to pgcoord.lease_terms_kept() per name.';

-- How many terms of each name are kept (the last ones, by fence): the setting
-- pgcoord.lease_terms_kept (ALTER DATABASE ... SET pgcoord.lease_terms_kept = 200),
-- 50 when unset or not a number. 0 turns the record off. Never raises: a bad
-- setting must not fail a takeover.
CREATE FUNCTION pgcoord.lease_terms_kept() RETURNS integer
    LANGUAGE sql STABLE
    SET search_path = pg_catalog, pgcoord, pg_temp
    RETURN (SELECT CASE WHEN s.v ~ '^ *[0-9]{1,9} *$' THEN s.v::integer ELSE 50 END
            FROM (SELECT pg_catalog.current_setting('pgcoord.lease_terms_kept', true) AS v) AS s);

-- One trigger function for every change of a lease row that starts or ends a
-- term. AFTER row triggers, so that only rows really written are recorded (a
-- BEFORE INSERT trigger would also fire for every lease_acquire that lost to a
-- live holder: INSERT ... ON CONFLICT fires it before finding the conflict), and
-- with WHEN clauses on the triggers, so that a renewal (which changes neither
-- fence, holder nor holder_pid) costs nothing here, not even a call.
--
-- How the term OLD ended, decided in this order (docs/leases.md):
--   expired        OLD.expires_at had passed: the lease's own clock ended it,
--                  at OLD.expires_at, whatever happened next (a takeover, a
--                  late release by its holder);
--   released       same fence, holder now NULL: given up while still valid;
--   session_ended  a new fence before the expiry, and the session the term was
--                  tied to (holder_pid, by its doorbell) is gone: its process
--                  died, its connection was cut, its member died;
--   taken_over     a new fence while the term was still valid by its own rules
--                  (unexpired, its session alive or none tied to it): pgcoord
--                  never does this itself; pgcoord.testing.take_leadership and SQL
--                  written by hand do.
-- The session is looked up only for a takeover before the expiry, and in pg_locks
-- only when its backend still exists: an expired takeover reads neither. A term
-- ended by a takeover ends when the new one began (its acquired_at).
--
-- SECURITY DEFINER (as the owner of the schema, with search_path pinned): the
-- record is pgcoord's own bookkeeping, so a role that may take a lease needs no
-- grant on lease_terms, and a database upgraded to 0009 without running roles.sql
-- again keeps taking leases.
CREATE FUNCTION pgcoord.lease_terms_record() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
DECLARE
    now_ timestamptz := pg_catalog.clock_timestamp();
    -- lease_terms_kept(), read here rather than called: a SQL function with a SET
    -- clause is planned again at every call, which a takeover would pay for.
    kept_setting text := pg_catalog.current_setting('pgcoord.lease_terms_kept', true);
    kept integer := 50;
    end_fence bigint;     -- the term that ends here, if any
    how text;
    ended timestamptz;
    resign timestamptz;
BEGIN
    IF kept_setting ~ '^ *[0-9]{1,9} *$' THEN
        kept := kept_setting::integer;
    END IF;
    IF kept <= 0 THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.holder IS NOT NULL THEN
        IF NEW.fence = OLD.fence AND NEW.holder IS NOT DISTINCT FROM OLD.holder THEN
            -- The same term, tied to a session now (lease_bind_session).
            INSERT INTO pgcoord.lease_terms AS t (name, fence, holder, holder_pid, started_at)
            VALUES (NEW.name, NEW.fence, NEW.holder, NEW.holder_pid, coalesce(NEW.acquired_at, now_))
            ON CONFLICT (name, fence) DO UPDATE SET holder_pid = excluded.holder_pid;
            RETURN NULL;
        END IF;
        end_fence := OLD.fence;
        resign := OLD.resign_requested_at;
        IF OLD.expires_at <= now_ THEN
            how := 'expired';
            ended := OLD.expires_at;
        ELSIF NEW.fence = OLD.fence THEN
            how := 'released';
            ended := now_;
        -- Gone: of this server incarnation (another one's sessions cannot be looked
        -- up, and count as alive), and either no such backend at all (cheap: the
        -- backend status array, not the lock table) or one without the doorbell.
        ELSIF OLD.holder_pid IS NOT NULL
              AND (OLD.holder_server IS NULL OR OLD.holder_server = pgcoord.server_incarnation())
              AND (NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(OLD.holder_pid))
                   OR NOT pgcoord.lease_session_alive(OLD.name, OLD.holder_pid, OLD.holder_server)) THEN
            how := 'session_ended';
        ELSE
            how := 'taken_over';
        END IF;
        IF ended IS NULL THEN
            -- Ended by the takeover itself: when the new term began.
            ended := LEAST(NEW.acquired_at, now_);
        END IF;
    END IF;
    IF NEW.holder IS NOT NULL AND (TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence) THEN
        -- Simple statements, each planned once per session (plpgsql's generic
        -- plans): one statement of data-modifying CTEs would be planned again at
        -- every call, its cost depending on whether this call prunes.
        -- Upserts, not UPDATEs, for the term that ends (and the bind above): under
        -- default_transaction_isolation = serializable an UPDATE's index scan takes
        -- predicate locks on the primary key's pages, and two takeovers of
        -- different names writing to one page then failed one of them with 40001;
        -- an upsert's conflict check takes none. (The prune reads, but only one
        -- takeover in 8 prunes, and two must meet for a conflict.) A term missing
        -- from the record (it started while the record was off) is recorded ended.
        IF end_fence IS NOT NULL THEN
            INSERT INTO pgcoord.lease_terms AS t
                (name, fence, holder, holder_pid, started_at, ended_at, ended_how, resign_requested_at)
            VALUES (NEW.name, end_fence, OLD.holder, OLD.holder_pid, coalesce(OLD.acquired_at, ended),
                    ended, how, resign)
            ON CONFLICT (name, fence) DO UPDATE
                SET ended_at = excluded.ended_at, ended_how = excluded.ended_how,
                    resign_requested_at = excluded.resign_requested_at
                WHERE t.ended_at IS NULL;
        END IF;
        -- A fence is reused only when the row was deleted and made again: the new
        -- term replaces the forgotten one.
        INSERT INTO pgcoord.lease_terms AS t (name, fence, holder, holder_pid, started_at)
        VALUES (NEW.name, NEW.fence, NEW.holder, NEW.holder_pid, coalesce(NEW.acquired_at, now_))
        ON CONFLICT (name, fence) DO UPDATE
            SET holder = excluded.holder, holder_pid = excluded.holder_pid,
                started_at = excluded.started_at, ended_at = NULL, ended_how = NULL,
                resign_requested_at = NULL;
        -- Retention: the last `kept` fences of this name (fences grow by one per
        -- term), pruned every 8th fence, 8 terms at a time (an index range on the
        -- primary key), so a name holds at most kept + 7 terms.
        IF pg_catalog.mod(NEW.fence, 8) = 0 THEN
            DELETE FROM pgcoord.lease_terms AS t
             WHERE t.name = NEW.name AND t.fence <= NEW.fence - kept;
        END IF;
    ELSIF end_fence IS NOT NULL THEN
        INSERT INTO pgcoord.lease_terms AS t
            (name, fence, holder, holder_pid, started_at, ended_at, ended_how, resign_requested_at)
        VALUES (NEW.name, end_fence, OLD.holder, OLD.holder_pid, coalesce(OLD.acquired_at, ended),
                ended, how, resign)
        ON CONFLICT (name, fence) DO UPDATE
            SET ended_at = excluded.ended_at, ended_how = excluded.ended_how,
                resign_requested_at = excluded.resign_requested_at
            WHERE t.ended_at IS NULL;
    END IF;
    RETURN NULL;
END
$body$;

CREATE TRIGGER lease_terms_started AFTER INSERT ON pgcoord.leases
    FOR EACH ROW WHEN (NEW.holder IS NOT NULL)
    EXECUTE FUNCTION pgcoord.lease_terms_record();

CREATE TRIGGER lease_terms_changed AFTER UPDATE ON pgcoord.leases
    FOR EACH ROW WHEN (OLD.fence IS DISTINCT FROM NEW.fence
                       OR OLD.holder IS DISTINCT FROM NEW.holder
                       OR OLD.holder_pid IS DISTINCT FROM NEW.holder_pid)
    EXECUTE FUNCTION pgcoord.lease_terms_record();

-- pgcoord never deletes a lease row (fences must never go backwards); one deleted
-- by hand takes its history with it, so the record never outgrows pgcoord.leases.
CREATE FUNCTION pgcoord.lease_terms_forget() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
BEGIN
    DELETE FROM pgcoord.lease_terms AS t WHERE t.name = OLD.name;
    RETURN NULL;
END
$body$;

CREATE TRIGGER lease_terms_forgotten AFTER DELETE ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.lease_terms_forget();

-- The leases held now start the record (their terms run, or ran out unrecorded).
INSERT INTO pgcoord.lease_terms (name, fence, holder, holder_pid, started_at)
SELECT l.name, l.fence, l.holder, l.holder_pid, coalesce(l.acquired_at, pg_catalog.clock_timestamp())
FROM pgcoord.leases AS l
WHERE l.holder IS NOT NULL;

-- The history as operators read it: lease_terms, where a term whose lease ran out
-- and was not taken since (nothing wrote the row, so no trigger ran) shows as
-- expired at its expiry rather than as running. No pg_locks here: whether a
-- running term's session is alive is pgcoord.holders' session_alive.
CREATE VIEW pgcoord.lease_history AS
SELECT t.name, t.fence, t.holder, t.holder_pid, t.started_at,
       coalesce(t.ended_at, CASE WHEN l.expires_at <= pg_catalog.clock_timestamp()
                                 THEN l.expires_at END)            AS ended_at,
       coalesce(t.ended_how, CASE WHEN l.expires_at <= pg_catalog.clock_timestamp()
                                  THEN 'expired' END)              AS ended_how,
       t.resign_requested_at
FROM pgcoord.lease_terms AS t
LEFT JOIN pgcoord.leases AS l ON l.name = t.name AND l.fence = t.fence AND l.holder IS NOT NULL;

COMMENT ON VIEW pgcoord.lease_history IS
    'pgcoord: pgcoord.lease_terms with the end of a term that ran out unrecorded (expired, not yet taken over).';


-- Names everywhere (issue 24): every lock pgcoord.holders shows carries its name.
--
-- The session locks pgcoord keeps for a lease (the holder's doorbell, the
-- candidates' candidacy lock on a member's watcher session) are named once per
-- lease name, when its row is made: rows are never deleted, so this runs once per
-- name ever, and never on a takeover. Partitions' parts are lease rows too.
CREATE FUNCTION pgcoord.lease_names_record() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
BEGIN
    INSERT INTO pgcoord.lock_names AS n (key, name)
    VALUES (pgcoord.lease_doorbell_key(NEW.name), 'pgcoord.elector:' || NEW.name),
           (pgcoord.lock_key('pgcoord.candidate:' || NEW.name), 'pgcoord.candidate:' || NEW.name)
    ON CONFLICT (key) DO NOTHING;
    RETURN NULL;
END
$body$;

CREATE TRIGGER lease_names_recorded AFTER INSERT ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.lease_names_record();

INSERT INTO pgcoord.lock_names (key, name)
SELECT pgcoord.lock_key(x.name), x.name
FROM (SELECT 'pgcoord.elector:' || l.name AS name FROM pgcoord.leases AS l
      UNION ALL
      SELECT 'pgcoord.candidate:' || l.name FROM pgcoord.leases AS l
      UNION ALL
      SELECT 'pgcoord.migrate') AS x
ON CONFLICT (key) DO NOTHING;

-- A member taking part in partitions names its participation lock
-- 'pgcoord.partitions:<name>:<member id>' (sql/partition_queries.sql,
-- partition_join): one name per member and partitions, forgotten here when the
-- member's row goes (its tombstone is deleted a minute after it left), so that
-- pgcoord.lock_names does not grow with every process ever started.
--
-- By an index of these names' member ids: pgcoord.lock_names holds every name
-- ever locked by (it is never cleaned), and a scan of it all per member row
-- deleted made a member's join, which deletes the tombstones, cost as much.
-- Partial, and of the id only, so that other names cost nothing more to record
-- and a long name never exceeds an index entry.
CREATE INDEX lock_names_partition_member ON pgcoord.lock_names
    (pg_catalog.substring(name, ':([0-9]+)$'))
    WHERE pg_catalog.starts_with(name, 'pgcoord.partitions:');

CREATE FUNCTION pgcoord.member_names_forget() RETURNS trigger
    LANGUAGE plpgsql
    SECURITY DEFINER
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
BEGIN
    DELETE FROM pgcoord.lock_names AS n
     WHERE pg_catalog.starts_with(n.name, 'pgcoord.partitions:')
       AND pg_catalog.substring(n.name, ':([0-9]+)$') = OLD.id::text;
    RETURN NULL;
END
$body$;

CREATE TRIGGER member_names_forgotten AFTER DELETE ON pgcoord.member_sessions
    FOR EACH ROW EXECUTE FUNCTION pgcoord.member_names_forget();

-- The trigger functions above run as the schema's owner: nobody but the owner may
-- put them on a table (EXECUTE is checked when a trigger is made, not when it
-- fires), or a role with a table of its own shaped like pgcoord.leases would
-- write and wipe pgcoord.lease_terms and pgcoord.lock_names through them.
REVOKE EXECUTE ON FUNCTION pgcoord.lease_terms_record(), pgcoord.lease_terms_forget(),
    pgcoord.lease_names_record(), pgcoord.member_names_forget() FROM PUBLIC;

-- The view names the rest: a transactional job's lock and a member's alive lock.
CREATE OR REPLACE VIEW pgcoord.holders AS
WITH lk AS MATERIALIZED (
    -- pg_locks, pg_stat_activity and the live members are read once each: the
    -- planner expects a row or so from pg_lock_status() and, joining in nested
    -- loops, would read the whole activity array again for every lock.
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key,
           l.classid, l.objid, l.objsubid, l.pid, l.mode, l.granted, l.waitstart
    FROM pg_catalog.pg_locks AS l
    -- IS TRUE: the planner's default guess for the equalities (a row or so of
    -- pg_lock_status()'s 1,000) would send the joins below into nested loops.
    WHERE (l.locktype = 'advisory'
           AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                             WHERE d.datname = pg_catalog.current_database())) IS TRUE
), act AS MATERIALIZED (
    SELECT a.pid, a.application_name, a.client_addr, a.xact_start, a.backend_start
    FROM pg_catalog.pg_stat_activity AS a
), live AS MATERIALIZED (
    SELECT m.pid, m.name FROM pgcoord.member_sessions AS m WHERE m.left_at IS NULL
), sem AS MATERIALIZED (
    -- Registered semaphore keys as pg_locks shows them (classid is an unsigned
    -- oid); names that collide on a key are listed together.
    SELECT (s.key::bigint & 4294967295)::oid AS classid, s.key,
           pg_catalog.string_agg(s.name, ' | ' ORDER BY s.name) AS name
    FROM pgcoord.semaphores AS s
    GROUP BY s.key
), jobkeys AS MATERIALIZED (
    -- A transactional job's run holds the transaction lock 'pgcoord.job:' || Slot.key
    -- (pgcoord/scheduler/runner.py), a key never recorded (one per slot, without
    -- bound): named here from the running slots, the only ones that can hold it.
    SELECT pgcoord.lock_key(r.name) AS key, r.name
    FROM (SELECT 'pgcoord.job:' || j.job || '@'
                 || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS')
                 || CASE WHEN pg_catalog.date_trunc('second', j.slot_at) <> j.slot_at
                         THEN '.' || pg_catalog.to_char(j.slot_at AT TIME ZONE 'UTC', 'US') ELSE '' END
                 || 'Z' AS name
          FROM pgcoord.job_slots AS j WHERE j.state = 'running') AS r
)
SELECT
    'advisory'::text                                   AS kind,
    -- A recorded name (pgcoord.lock_names), a running job's lock, or a member's
    -- alive lock (member_alive_ns(), id): 'pgcoord.member:<group>/<name>'.
    -- Also the register of listeners that 0010 keeps (key space 1885823854, two-int
    -- form: a listener's shared lock per channel code, a teller's gate at code + 100).
    coalesce(n.name, jk.name, 'pgcoord.member:' || mv."group" || '/' || mv.name,
             CASE WHEN l.objsubid = 2 AND l.classid = 1885823854::oid THEN
                 CASE WHEN l.objid >= 100 THEN 'pgcoord.news-gate:' ELSE 'pgcoord.listener:' END
                 || CASE pg_catalog.mod(l.objid::bigint, 100) WHEN 1 THEN 'pgcoord_leases' WHEN 2 THEN 'pgcoord_members'
                         WHEN 3 THEN 'pgcoord_schedules' WHEN 4 THEN 'pgcoord_partitions'
                         ELSE l.objid::text END
             END) AS name,
    l.key                                              AS key,
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
FROM lk AS l
LEFT JOIN act AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = l.key AND l.objsubid = 1
LEFT JOIN jobkeys AS jk ON jk.key = l.key AND l.objsubid = 1 AND n.key IS NULL
LEFT JOIN pgcoord.member_sessions AS mv
       ON l.objsubid = 2 AND l.classid = 1885823853::oid AND mv.id::bigint = l.objid::bigint
LEFT JOIN live AS ms ON ms.pid = l.pid
WHERE NOT (l.objsubid = 2 AND l.classid IN (SELECT sem.classid FROM sem))
UNION ALL
-- A granted lane is a holder; the waiting room (lane -1) holds the waiters,
-- shown as not granted, with `since` NULL (see 0005).
SELECT
    'semaphore'::text, sem.name, sem.key::bigint,
    coalesce(nullif(a.application_name, ''), 'pid ' || l.pid::text), l.pid,
    a.application_name, a.client_addr,
    (l.objid <> 4294967295::oid),
    CASE WHEN l.objid <> 4294967295::oid THEN coalesce(a.xact_start, a.backend_start) END,
    NULL::timestamptz, NULL::bigint, NULL::integer[], false, (a.pid IS NOT NULL), ms.name,
    CASE WHEN l.objid <> 4294967295::oid THEN l.objid::bigint::integer END
FROM lk AS l
JOIN sem ON sem.classid = l.classid
LEFT JOIN act AS a ON a.pid = l.pid
LEFT JOIN live AS ms ON ms.pid = l.pid
WHERE l.objsubid = 2 AND l.granted
UNION ALL
-- A session of another server incarnation cannot be looked up here: it is
-- neither alive nor dead (NULL), and its pid may be an unrelated session's.
SELECT
    'lease'::text, s.name, NULL::bigint, s.holder, s.holder_pid, a.application_name,
    a.client_addr, true, s.acquired_at, s.expires_at, s.fence, NULL::integer[], false,
    CASE WHEN s.holder_pid IS NULL OR NOT here.here THEN NULL
         ELSE pgcoord.lease_session_alive(s.name, s.holder_pid, s.holder_server) END,
    ms.name, NULL::integer
FROM pgcoord.leases AS s
CROSS JOIN LATERAL (
    SELECT s.holder_server IS NULL OR s.holder_server = pgcoord.server_incarnation() AS here
) AS here
LEFT JOIN act AS a ON here.here AND a.pid = s.holder_pid
LEFT JOIN live AS ms ON here.here AND ms.pid = s.holder_pid
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

