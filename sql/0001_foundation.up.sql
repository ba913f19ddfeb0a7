-- pgcoord 0001: the foundation. Schema objects every later feature builds on.
-- Executed verbatim by migrations/versions/0001_foundation.py; keep it valid plain SQL.
-- Avoid percent signs and colon-prefixed words: drivers treat them as placeholders.

-- The string key scheme, identical to pgcoord.lock_key() in Python:
-- first 8 bytes of sha256(utf-8 name), big-endian, signed. Stable forever.
CREATE FUNCTION pgcoord.lock_key(name text) RETURNS bigint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN ('x' || pg_catalog.left(pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(name, 'UTF8')), 'hex'), 16))::bit(64)::bigint;

COMMENT ON FUNCTION pgcoord.lock_key(text) IS
    'Advisory-lock key of a pgcoord lock name: first 8 bytes of SHA-256 of the UTF-8 name, big-endian, signed.';

-- Names of string keys, so operators see names rather than numbers. Written once
-- per process and name, outside the lock's own transaction.
CREATE TABLE pgcoord.lock_names (
    key        bigint PRIMARY KEY,
    name       text NOT NULL,
    first_seen timestamptz NOT NULL DEFAULT pg_catalog.now()
);

-- Who holds what. One row per advisory lock held or awaited in this database.
-- A bigint advisory key k is stored as classid = high 32 bits, objid = low 32
-- bits, objsubid = 1; both are unsigned oids, so the shift is done on bigint and
-- wraps into the signed range exactly as the key was given.
CREATE VIEW pgcoord.holders AS
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
    (l.mode = 'ShareLock')                             AS shared
FROM pg_catalog.pg_locks AS l
CROSS JOIN LATERAL (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
) AS k
LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
LEFT JOIN pgcoord.lock_names AS n ON n.key = k.key AND l.objsubid = 1
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database());

COMMENT ON VIEW pgcoord.holders IS
    'pgcoord: one row per current holder or waiter (advisory locks; leases and jobs join in later revisions).';
