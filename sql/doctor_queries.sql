-- Queries of `pgcoord doctor` (pgcoord/doctor.py): read-only, any role may run them.

-- name: doctor_server
-- The server, the session's settings and the clock, in one round trip.
SELECT pg_catalog.current_setting('server_version_num')::int,
       pg_catalog.current_setting('server_version'),
       pg_catalog.pg_is_in_recovery(),
       pg_catalog.pg_backend_pid(),
       pg_catalog.current_setting('synchronous_commit'),
       extract(epoch FROM pg_catalog.clock_timestamp())::float8,
       current_user

-- name: doctor_schema_installed
-- Whether the version table exists, and whether this role may read it (the service
-- role of sql/roles.sql may not). From the catalog: to_regclass() sees nothing in a
-- schema the role has no USAGE on.
SELECT c.oid IS NOT NULL,
       c.oid IS NOT NULL AND pg_catalog.has_schema_privilege('pgcoord', 'USAGE')
         AND pg_catalog.has_table_privilege(c.oid, 'SELECT')
FROM (SELECT) AS one
LEFT JOIN pg_catalog.pg_class AS c
  ON c.relname = 'alembic_version'
 AND c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace WHERE nspname = 'pgcoord')

-- name: doctor_schema_version
SELECT version_num FROM pgcoord.alembic_version

-- name: doctor_capacity
-- The lock table's size (its slots are shared by every session: max_locks_per_transaction
-- times the server's connections and prepared transactions), the advisory locks in it
-- now, and the connection slots: all, reserved for superusers (and, from 16, for
-- pg_use_reserved_connections), in use.
SELECT pg_catalog.current_setting('max_locks_per_transaction')::int
         * (pg_catalog.current_setting('max_connections')::int
            + pg_catalog.current_setting('max_prepared_transactions')::int),
       (SELECT count(*) FROM pg_catalog.pg_locks WHERE locktype = 'advisory'),
       pg_catalog.current_setting('max_connections')::int,
       pg_catalog.current_setting('superuser_reserved_connections')::int
         + COALESCE(pg_catalog.current_setting('reserved_connections', true)::int, 0),
       (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'client backend')

-- name: doctor_standbys
-- The standbys streaming from this server: all, those whose commits wait for them
-- (sync_state sync or quorum), and those whose state this role may not see (a role
-- without pg_monitor sees the rows, with NULL in their columns), the standbys
-- commits are told to wait for (synchronous_standby_names), those commits do not
-- wait for (async, potential: promoting one loses commits) and those in a quorum.
-- Logical walsenders (subscribers, CDC) are listed too, as async; they are no
-- standby anyone can promote, so they are left out by their slot's active pid.
-- Last, the standby whose clock is furthest ahead of this server's, and by how many
-- seconds: its replies are stamped by its clock (reply_time), and arrive after they
-- were sent, so a reply stamped later than now() comes from a clock ahead.
SELECT count(*),
       count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')),
       count(*) FILTER (WHERE r.sync_state IS NULL),
       pg_catalog.current_setting('synchronous_standby_names'),
       coalesce(pg_catalog.string_agg(coalesce(nullif(r.application_name, ''), 'pid ' || r.pid::text),
                                      ', ' ORDER BY r.application_name)
                FILTER (WHERE r.sync_state IN ('async', 'potential')), ''),
       count(*) FILTER (WHERE r.sync_state = 'quorum'),
       (pg_catalog.array_agg(coalesce(nullif(r.application_name, ''), 'pid ' || r.pid::text)
                             ORDER BY r.reply_time DESC) FILTER (WHERE r.reply_time IS NOT NULL))[1],
       extract(epoch FROM max(r.reply_time) - pg_catalog.clock_timestamp())::float8
FROM pg_catalog.pg_stat_replication AS r
WHERE r.pid NOT IN (SELECT s.active_pid FROM pg_catalog.pg_replication_slots AS s
                    WHERE s.slot_type = 'logical' AND s.active_pid IS NOT NULL)

-- name: doctor_role_synchronous_commit
-- Role $1's own synchronous_commit (ALTER ROLE ... SET, for this database first, then
-- for every database), or NULL when it has none and gets what other sessions get.
SELECT pg_catalog.substr(c.setting, pg_catalog.length('synchronous_commit=') + 1)
FROM pg_catalog.pg_db_role_setting AS s
JOIN pg_catalog.pg_roles AS r ON r.oid = s.setrole AND r.rolname = $1
CROSS JOIN LATERAL pg_catalog.unnest(s.setconfig) AS c(setting)
WHERE pg_catalog.starts_with(c.setting, 'synchronous_commit=')
  AND s.setdatabase IN (0, (SELECT d.oid FROM pg_catalog.pg_database AS d
                            WHERE d.datname = pg_catalog.current_database()))
ORDER BY s.setdatabase DESC
LIMIT 1

-- name: doctor_missing_privileges
-- Whether role $1 exists and is a superuser (NULL: no such role), and which of the
-- grants ($2 kinds, $3 objects, $4 privileges: sql/roles.sql's service grants, read by
-- doctor.py) it lacks, as 'PRIVILEGE on object, ...' or NULL. Objects of revisions not
-- installed are skipped. Found in the catalog by name and checked by oid: by name, a
-- role without USAGE on the schema would see none of them.
WITH r AS (SELECT CAST($1 AS text) AS role)
SELECT (SELECT rolsuper FROM pg_catalog.pg_roles, r WHERE rolname = r.role),
       (SELECT pg_catalog.string_agg(g.privilege || ' on ' || g.object, ', ')
        FROM r, ROWS FROM (pg_catalog.unnest(CAST($2 AS text[])), pg_catalog.unnest(CAST($3 AS text[])),
                           pg_catalog.unnest(CAST($4 AS text[]))) AS g(kind, object, privilege)
        LEFT JOIN pg_catalog.pg_class AS c
          ON c.relname = pg_catalog.split_part(g.object, '.', 2)
         AND c.relnamespace = (SELECT oid FROM pg_catalog.pg_namespace
                               WHERE nspname = pg_catalog.split_part(g.object, '.', 1))
        WHERE EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = r.role)
          AND CASE g.kind
            WHEN 'schema' THEN NOT pg_catalog.has_schema_privilege(r.role, g.object, g.privilege)
            WHEN 'sequence' THEN c.oid IS NOT NULL
                AND NOT pg_catalog.has_sequence_privilege(r.role, c.oid, g.privilege)
            ELSE c.oid IS NOT NULL AND NOT pg_catalog.has_table_privilege(r.role, c.oid, g.privilege)
          END)

-- name: doctor_lease_ttls
-- The shortest and longest ttl of the leases held now (every tenure renews its row to
-- renewed_at + ttl): what the deployment really uses, for `doctor --patroni`.
SELECT min(extract(epoch FROM expires_at - renewed_at))::float8,
       max(extract(epoch FROM expires_at - renewed_at))::float8
FROM pgcoord.leases
WHERE holder IS NOT NULL AND expires_at > pg_catalog.clock_timestamp()
