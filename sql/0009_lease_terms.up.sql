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
--                  never does this itself; pgcoord.testing.take_lease and SQL
--                  written by hand do.
-- The session is looked up (pg_locks) only in the last case, where the takeover
-- itself has just looked it up: an expired takeover reads no pg_locks here.
CREATE FUNCTION pgcoord.lease_terms_record() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
DECLARE
    now_ timestamptz := pg_catalog.clock_timestamp();
    kept integer := pgcoord.lease_terms_kept();
    how text;
    ended timestamptz;
BEGIN
    IF kept <= 0 THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.holder IS NOT NULL THEN
        IF NEW.fence = OLD.fence AND NEW.holder IS NOT DISTINCT FROM OLD.holder THEN
            -- The same term, tied to a session now (lease_bind_session).
            UPDATE pgcoord.lease_terms AS t SET holder_pid = NEW.holder_pid
             WHERE t.name = NEW.name AND t.fence = NEW.fence;
            RETURN NULL;
        END IF;
        IF OLD.expires_at <= now_ THEN
            how := 'expired';
            ended := OLD.expires_at;
        ELSIF NEW.fence = OLD.fence THEN
            how := 'released';
            ended := now_;
        ELSIF OLD.holder_pid IS NOT NULL
              AND NOT pgcoord.lease_session_alive(OLD.name, OLD.holder_pid, OLD.holder_server) THEN
            how := 'session_ended';
            ended := now_;
        ELSE
            how := 'taken_over';
            ended := now_;
        END IF;
        UPDATE pgcoord.lease_terms AS t
           SET ended_at = ended, ended_how = how, resign_requested_at = OLD.resign_requested_at
         WHERE t.name = OLD.name AND t.fence = OLD.fence AND t.ended_at IS NULL;
    END IF;
    IF NEW.holder IS NOT NULL AND (TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence) THEN
        -- A fence is reused only when the row was deleted and made again: the new
        -- term replaces the forgotten one.
        INSERT INTO pgcoord.lease_terms AS t (name, fence, holder, holder_pid, started_at)
        VALUES (NEW.name, NEW.fence, NEW.holder, NEW.holder_pid, coalesce(NEW.acquired_at, now_))
        ON CONFLICT (name, fence) DO UPDATE
            SET holder = excluded.holder, holder_pid = excluded.holder_pid,
                started_at = excluded.started_at, ended_at = NULL, ended_how = NULL,
                resign_requested_at = NULL;
        -- Retention: the last `kept` fences of this name. Fences grow by one per
        -- term, so this deletes the one term that just fell out (an index range on
        -- the primary key), or more after the setting was lowered.
        DELETE FROM pgcoord.lease_terms AS t
         WHERE t.name = NEW.name AND t.fence <= NEW.fence - kept;
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
