-- Runtime SQL of pgcoord.Member (see sql/0004_members.up.sql), in the format of
-- queries.sql: `-- name: <name>` then the text; $1, $2 are bind parameters.

-- name: member_session
-- The member's main session: the server ends it after {idle_ms} ms of silence,
-- so a paused or partitioned member loses its alive lock and is announced gone.
-- It is shared by every feature on the member, so no statement on it may wait
-- long for a row or lock (a fenced transaction holding a lease row FOR SHARE):
-- lock_timeout turns such a wait into an error the feature treats as "busy" or
-- "retry". A backend stuck in a statement after its client went away is ended
-- within a second (client_connection_check_interval), releasing its locks.
SET idle_session_timeout = {idle_ms}; SET lock_timeout = 500; SET client_connection_check_interval = 1000

-- name: member_watcher_session
-- The watcher waits in the lock queue for its successor's alive lock. Once
-- granted it goes idle; if this process is paused then, the server ends the
-- session after {idle_ms} ms so the lock does not hide the death from others.
-- A dead client is noticed during the wait too (client_connection_check_interval).
SET idle_session_timeout = {idle_ms}; SET client_connection_check_interval = 1000

-- name: member_join
-- $7: the process the member lives in, host:pid (pgcoord.member_join_from, 0011).
SELECT id, joined_at FROM pgcoord.member_join_from($1, $2, $3::jsonb, $4, $5, $6, $7)

-- name: member_leave
SELECT pgcoord.member_leave($1)

-- name: member_reap
SELECT pgcoord.member_reap($1)

-- name: member_reap_dead
-- After a watcher was granted a dead member's alive lock: mark gone, and announce in
-- one NOTIFY per group, every member with a session whose alive lock no session
-- holds, in every group (pgcoord.member_reap_dead, 0010). A row is written only
-- after its member took its lock, so a row without a held lock is a dead member's.
-- Returns [[id, reason], ...] for those this statement marked.
-- (A dead member's lock may be held by a watcher that was granted it: only the
-- member's own session, its pid, holding it makes it alive.)
SELECT pgcoord.member_reap_dead()

-- name: member_beat
-- A heartbeat (NULL: this member was declared dead), the group's sweep when this
-- member is its sweeper, and with $2 the group as member_state shapes it, from the
-- rows alone (pgcoord.member_beat, 0011).
SELECT pgcoord.member_beat($1, $2)

-- name: member_state
-- The ring (the watcher ring spans all groups, so that every death is seen by
-- someone; members behind a pooler hold no alive lock to wait for, and are judged
-- by their heartbeats instead), the live members of group $1, and why its recent
-- departures left (for members that poll); as JSON so that every driver
-- returns the same shape. The ring is every member with a session whose death is
-- not recorded yet, as member_ring reads it: a member leaves the ring (and is told
-- to the on_member_left hooks) only once its row says why it left.
WITH live AS MATERIALIZED (SELECT * FROM pgcoord.members),
     grp AS (SELECT $1::text AS name)
SELECT pg_catalog.json_build_object(
    'ring', coalesce((SELECT pg_catalog.json_agg(m.id ORDER BY m.id) FROM pgcoord.member_sessions AS m
                      WHERE m.left_at IS NULL AND m.has_session), '[]'),
    'peers', coalesce((
        SELECT pg_catalog.json_agg(pg_catalog.json_build_object(
                   'id', m.id, 'name', m.name, 'group', m."group", 'meta', m.meta,
                   'joined_at', pg_catalog.to_char(m.joined_at AT TIME ZONE 'UTC',
                                                   'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'))
               ORDER BY m.id)
        FROM live AS m, grp WHERE m."group" = grp.name), '[]'),
    -- A dead member not marked yet (its heartbeat ran out between a sweep and this
    -- read) is given the reason its marking will give it.
    'gone', coalesce((
        SELECT pg_catalog.json_object_agg(
                   g.id, coalesce(g.left_reason, pgcoord.member_left_reason(g.heartbeat_at, g.ttl_ms)))
        FROM pgcoord.member_sessions AS g, grp
        WHERE g."group" = grp.name
          AND (g.left_at IS NOT NULL OR NOT EXISTS (SELECT 1 FROM live AS l WHERE l.id = g.id))), '{}'))::text

-- name: member_wait_reap
-- Blocks until member $1's session is gone (a share of its alive lock is granted, and
-- held: the watcher gives it back with member_unwatch), then marks gone and tells
-- every dead member, as member_reap_dead, in one statement (pgcoord.member_wait_reap,
-- 0011).
SELECT pgcoord.member_wait_reap($1)

-- name: member_unwatch
-- The share of a dead member's alive lock member_wait_reap was granted.
SELECT pg_catalog.pg_advisory_unlock_shared(1885823853, $1)

-- name: member_unwatch_if_held
-- After a cancelled wait: the grant may have come just before the cancel.
WITH target AS (SELECT CAST($1 AS integer) AS id)
SELECT pg_catalog.pg_advisory_unlock_shared(1885823853, target.id)
FROM target, pg_catalog.pg_locks AS l
WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.pid = pg_catalog.pg_backend_pid()
  AND l.classid = 1885823853 AND l.objid = target.id::oid AND l.mode = 'ShareLock' AND l.granted

-- name: member_idle
-- A watcher with nobody to watch sleeps on the server: a poke or a retarget cuts
-- it short (pg_cancel_backend), and the session does not fall silent meanwhile.
-- The marker lets a member that joins find a lonely watcher (member_poke_predecessor).
SELECT pg_catalog.pg_sleep($1) /* pgcoord:member_idle */

-- name: member_ring
-- Every member with a session whose death is not recorded yet, in ring order (as
-- member_state's 'ring' and member_beat's), from the rows alone. Not the live members
-- (pgcoord.members, pg_locks): a member whose session had just ended dropped out of
-- that ring before anyone marked its row, and the watcher that read it told the
-- on_member_left hooks of a death whose row still had no left_reason (a watcher woken
-- from member_idle just after its new successor was killed; the reap that recorded
-- 'crashed' committed milliseconds later). A dead member not yet marked stays in
-- the ring: the watcher before it is granted its lock at once, and reaps it.
SELECT coalesce(pg_catalog.json_agg(m.id ORDER BY m.id), '[]')::text
FROM pgcoord.member_sessions AS m WHERE m.left_at IS NULL AND m.has_session

-- name: member_left_reasons
-- Why the members $1 (an array of ids) are gone, as their rows say: a watcher that
-- found its target marked by another watcher tells its own member the row's reason
-- (a crash is not a goodbye). A JSON object id -> reason; null for a row not marked
-- yet (its death is not told until it is); a row already swept is absent.
SELECT coalesce(pg_catalog.json_object_agg(
           m.id, CASE WHEN m.left_at IS NOT NULL THEN m.left_reason END), '{}')::text
FROM pgcoord.member_sessions AS m
WHERE m.id = ANY (CAST($1 AS integer[]))

-- name: member_settle
-- After the members $1 (an array of ids) were found dead: wake the candidates of the leases its session
-- held (cancel the waits of the sessions holding their candidacy locks: see
-- pgcoord/member/ring.py), and expire its running job claims, so that neither
-- waits for a broadcast. Returns how many sessions were woken. The lock table is
-- read only if the dead held a lease: a crash's settle runs on every watcher that
-- found a death, just as the crash's NOTIFY is being delivered, and most members hold
-- none.
WITH arg AS (SELECT CAST($1 AS integer[]) AS ids), dead AS (
    SELECT m.pid FROM pgcoord.member_sessions AS m, arg
    WHERE m.id = ANY (arg.ids) AND m.left_at IS NOT NULL
), keys AS (
    SELECT pgcoord.lock_key('pgcoord.candidate:' || s.name) AS key
    FROM pgcoord.leases AS s, dead WHERE s.holder_pid = dead.pid
), woken AS (
    SELECT pg_catalog.pg_cancel_backend(l.pid) AS ok
    FROM pg_catalog.pg_locks AS l
    JOIN keys AS k ON ((l.classid::bigint << 32) | l.objid::bigint) = k.key
    WHERE EXISTS (SELECT 1 FROM keys)
      AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ShareLock'
      AND l.pid <> pg_catalog.pg_backend_pid()
      AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                        WHERE d.datname = pg_catalog.current_database())
)
SELECT (SELECT pg_catalog.count(*) FROM woken)::integer AS woken,
       (SELECT pg_catalog.sum(pgcoord.job_expire_member_claims(x)) FROM arg, pg_catalog.unnest(arg.ids) AS x)
           AS claims_expired

-- name: lease_poke
-- Lease $1 was let go of: wake its candidates (the sessions holding its candidacy
-- lock, see member_settle). Returns how many.
SELECT pg_catalog.count(pg_catalog.pg_cancel_backend(l.pid))::integer
FROM pg_catalog.pg_locks AS l
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ShareLock'
  AND ((l.classid::bigint << 32) | l.objid::bigint) = pgcoord.lock_key('pgcoord.candidate:' || $1)
  AND l.pid <> pg_catalog.pg_backend_pid()
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                    WHERE d.datname = pg_catalog.current_database())

-- name: member_poke_predecessor
-- A member that just joined in front of member $1 (its successor in the ring):
-- the watcher waiting for $1's alive lock belongs to our predecessor, who must
-- watch us now; or, if the ring had one member, that member's watcher sleeps
-- (member_idle). Cut its wait short; it reads the ring afresh.
WITH db AS (SELECT d.oid FROM pg_catalog.pg_database AS d
            WHERE d.datname = pg_catalog.current_database()),
waiting AS (
    SELECT l.pid FROM pg_catalog.pg_locks AS l, db
    WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND NOT l.granted AND l.database = db.oid
      AND l.classid = pgcoord.member_alive_ns()::oid AND l.objid = CAST($1 AS integer)::oid
    UNION
    SELECT a.pid FROM pg_catalog.pg_stat_activity AS a, db
    WHERE a.datid = db.oid AND a.state = 'active'
      AND pg_catalog.strpos(a.query, 'pgcoord:member' || '_idle') > 0  -- split: not this text
)
SELECT pg_catalog.count(pg_catalog.pg_cancel_backend(w.pid))::integer FROM waiting AS w
WHERE w.pid <> pg_catalog.pg_backend_pid()

-- name: member_cancel_watch
-- Cut watcher $1's wait short (a retarget, a new stand): cancel it, but only while it
-- waits (for a lock, or in member_idle). A cancel that reaches a backend between two
-- statements is dropped by the server, and one that lands on a short statement of
-- the watcher's is a needless error: the caller asks again until the watcher has
-- looked (pgcoord/member/ring.py). True when a cancel was sent.
SELECT coalesce(pg_catalog.bool_or(pg_catalog.pg_cancel_backend(a.pid)), false)
FROM pg_catalog.pg_stat_activity AS a
WHERE a.pid = $1 AND a.state = 'active'
  AND (a.wait_event_type = 'Lock' OR pg_catalog.strpos(a.query, 'pgcoord:member' || '_idle') > 0)

-- name: job_expire_member_claims
SELECT pgcoord.job_expire_member_claims($1)

-- name: lease_renew_resign
-- Renew an elector's lease: NULL when it could not be (lost), else whether a
-- resign was requested for this term.
SELECT resign FROM pgcoord.lease_renew_asking($1, $2, $3, $4)

-- name: lease_request_resign
SELECT pgcoord.request_resign($1)

-- name: lease_bind_session
SELECT pgcoord.lease_bind_session($1, $2, $3, $4)
