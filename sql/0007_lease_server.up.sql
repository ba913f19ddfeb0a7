-- pgcoord 0007: a lease's session is judged gone only on the server it lived on.
-- Executed verbatim by migrations/versions/0007_lease_server.py.
--
-- A lease that names its holder's session (elector leases, leases of a Member) may
-- be taken over as soon as that session is gone, without waiting out the ttl:
-- the holder heard of its own session's end first. That holds on one server. After
-- a failover (a standby promoted) or a restart, the new server has no such session
-- to look for: the holder may still be running, on a half-open connection to a
-- primary whose host vanished, and believes until its trust window closes. So a
-- lease row remembers which server incarnation its session was on, and a session
-- of another incarnation counts as alive: the lease is taken over when it expires,
-- after its holder stopped believing.

ALTER TABLE pgcoord.leases ADD COLUMN holder_server text;
COMMENT ON COLUMN pgcoord.leases.holder_server IS
    'pgcoord: the server incarnation (pgcoord.server_incarnation()) holder_pid belongs to.';

-- This server's incarnation: when its postmaster started (a restart changes it)
-- and its WAL timeline (a promotion changes it). NULL on a standby, which writes
-- no lease rows and whose timeline is not yet its own.
CREATE FUNCTION pgcoord.server_incarnation() RETURNS text
    LANGUAGE sql STABLE
    RETURN CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN
        EXTRACT(epoch FROM pg_catalog.pg_postmaster_start_time())::text || '/' ||
        pg_catalog.substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8)
    END;

-- Every write that names a holder's session also names the incarnation, whichever
-- statement does it (acquire, a member moving its leases to a new session, partitions).
CREATE FUNCTION pgcoord.leases_note_server() RETURNS trigger
    LANGUAGE plpgsql
    AS $body$
BEGIN
    NEW.holder_server := CASE WHEN NEW.holder_pid IS NOT NULL THEN pgcoord.server_incarnation() END;
    RETURN NEW;
END
$body$;

CREATE TRIGGER leases_note_server BEFORE INSERT OR UPDATE OF holder_pid ON pgcoord.leases
    FOR EACH ROW EXECUTE FUNCTION pgcoord.leases_note_server();

-- True while the session that took a lease still holds its doorbell, and also while
-- that session lived on another incarnation of the server (it cannot be looked up
-- here: the lease expires instead). Rows written before 0007 name no incarnation
-- and are judged by the doorbell alone, as before.
CREATE OR REPLACE FUNCTION pgcoord.lease_session_alive(lease_name text, pid integer) RETURNS boolean
    LANGUAGE sql STABLE
    RETURN pid IS NOT NULL AND (
        EXISTS (
            SELECT 1 FROM pg_catalog.pg_locks AS l
            WHERE l.locktype = 'advisory' AND l.granted AND l.pid = lease_session_alive.pid
              AND l.objsubid = 1
              AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lease_doorbell_key(lease_name)
        )
        OR EXISTS (
            SELECT 1 FROM pgcoord.leases AS s
            WHERE s.name = lease_name AND s.holder_pid = lease_session_alive.pid
              AND s.holder_server IS NOT NULL
              AND s.holder_server IS DISTINCT FROM pgcoord.server_incarnation()
        )
    );
