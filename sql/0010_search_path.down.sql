-- pgcoord 0010 down: pgcoord's news is told again whether heard or not (0004's
-- and 0006's bodies), and the register of listeners goes.
--
-- The pinned search_path stays on every function, including four put back here
-- (member_sessions_alive goes back as it was: a string body, inlined, unpinned): it changes nothing for a role with the default search_path, removing it
-- would only reopen the hole, and a down migration cannot tell which functions a
-- later (or concurrent) migration pinned on purpose. Going up again pins what
-- is left unpinned and skips the rest.

CREATE OR REPLACE FUNCTION pgcoord.member_notify(ev text, grp text, member_id integer, reason text)
    RETURNS void
    LANGUAGE sql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
        SELECT pg_catalog.pg_notify('pgcoord_members',
            pg_catalog.json_build_object('ev', ev, 'group', grp, 'id', member_id,
                                         'reason', reason)::text)
    $body$;

DROP TRIGGER lease_told_changed ON pgcoord.leases;
DROP TRIGGER lease_told ON pgcoord.leases;
DROP FUNCTION pgcoord.lease_told();

CREATE OR REPLACE FUNCTION pgcoord.lease_news() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
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

CREATE OR REPLACE FUNCTION pgcoord.schedules_changed() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    DECLARE
        bumped bigint;
    BEGIN
        IF NOT EXISTS (SELECT 1 FROM changed) THEN
            RETURN NULL;
        END IF;
        UPDATE pgcoord.schedule_epoch SET epoch = epoch + 1 RETURNING epoch INTO bumped;
        PERFORM pg_catalog.pg_notify('pgcoord_schedules', bumped::text);
        RETURN NULL;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.schedule_owed_added() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pgcoord, pg_temp
    AS $body$
    BEGIN
        IF EXISTS (SELECT 1 FROM added) THEN
            PERFORM pg_catalog.pg_notify('pgcoord_schedules', 'owed');
        END IF;
        RETURN NULL;
    END
    $body$;

CREATE OR REPLACE FUNCTION pgcoord.member_sessions_alive() RETURNS TABLE (id integer, pid integer)
    LANGUAGE sql STABLE
    AS $body$
        SELECT l.objid::bigint::integer, l.pid
        FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
          AND l.classid = pgcoord.member_alive_ns()::oid
          AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                            WHERE d.datname = pg_catalog.current_database())
    $body$;

DROP FUNCTION pgcoord.member_reap_dead();
DROP FUNCTION pgcoord.notify_heard(text, text, boolean);
DROP FUNCTION pgcoord.ears_close(text);
DROP FUNCTION pgcoord.ears_open(text);
DROP FUNCTION pgcoord.ears_code(text);
DROP FUNCTION pgcoord.ears_ns();
