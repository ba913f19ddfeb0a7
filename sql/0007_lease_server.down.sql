-- pgcoord 0007 down: back to judging a lease's session by its doorbell alone.

CREATE OR REPLACE FUNCTION pgcoord.lease_session_alive(lease_name text, pid integer) RETURNS boolean
    LANGUAGE sql STABLE
    RETURN pid IS NOT NULL AND EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.granted AND l.pid = lease_session_alive.pid
          AND l.objsubid = 1
          AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lease_doorbell_key(lease_name)
    );

DROP TRIGGER leases_note_server ON pgcoord.leases;
DROP FUNCTION pgcoord.leases_note_server();
DROP FUNCTION pgcoord.server_incarnation();
ALTER TABLE pgcoord.leases DROP COLUMN holder_server;
