-- Runtime SQL, one named block per statement: `-- name: <name>` then the text.
-- Names are grouped by what they touch. {fn} is one of pgcoord's fixed advisory
-- function names and {key}/{timeout_ms} are integers validated in Python: they
-- are inlined so that a lock is one simple-protocol statement with no parse step.
-- $1, $2 are bind parameters, rewritten per driver.

-- name: advisory_wait
SELECT pg_catalog.{fn}({key})

-- name: advisory_call
-- One advisory function with the key bound, for drivers that prepare repeated
-- statements (psycopg, SQLAlchemy): one plan serves every key.
SELECT pg_catalog.{fn}($1)

-- name: begin_and_lock
-- BEGIN and the lock in one simple-protocol message, so they share a round trip.
-- {mode} is empty or the transaction's characteristics (ISOLATION LEVEL ..., READ
-- ONLY, DEFERRABLE) picked from fixed lists in Python; {lock} is one of the
-- advisory_* statements with its key inlined.
BEGIN{mode}; {lock}

-- name: advisory_try
-- The try form raises instead of returning false so that it can share a round
-- trip with BEGIN in one simple-protocol message.
DO $pgcoord$ BEGIN
    IF NOT pg_catalog.{fn}({key}) THEN
        RAISE EXCEPTION 'pgcoord: advisory lock is held by another session' USING ERRCODE = 'PC001';
    END IF;
END $pgcoord$

-- name: advisory_timeout
-- lock_timeout applies to this one statement only: it is restored afterwards so
-- the body's own statements keep the session's setting. On error the enclosing
-- transaction or savepoint rollback discards it.
DO $pgcoord$
DECLARE previous text := pg_catalog.current_setting('lock_timeout');
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', '{timeout_ms}ms', true);
    PERFORM pg_catalog.{fn}({key});
    PERFORM pg_catalog.set_config('lock_timeout', previous, true);
END $pgcoord$

-- name: advisory_untimed_arm
-- A waiting lock whose only bound is pgcoord's own ({timeout_ms} ms; 0 for "until
-- granted") is three statements: this one, advisory_untimed_lock and
-- advisory_untimed_disarm, sent as one simple-protocol message (or queued
-- together in a psycopg pipeline). The server's, database's or role's
-- lock_timeout and statement_timeout must not cut it. statement_timeout is armed
-- when a statement starts, so both are set (for the transaction) before the lock's
-- own statement and put back right after it, in the caller's transaction too; the
-- previous values wait in transaction-local pgcoord.saved_* settings (placeholders:
-- after the transaction they read '' and are not in pg_settings). On error the
-- enclosing transaction or savepoint rollback discards all of them.
WITH saved AS MATERIALIZED (
    SELECT pg_catalog.current_setting('lock_timeout') AS lock_timeout,
           pg_catalog.current_setting('statement_timeout') AS statement_timeout
)
SELECT pg_catalog.set_config('pgcoord.saved_lock_timeout', saved.lock_timeout, true),
       pg_catalog.set_config('pgcoord.saved_statement_timeout', saved.statement_timeout, true),
       pg_catalog.set_config('lock_timeout', '{timeout_ms}ms', true),
       pg_catalog.set_config('statement_timeout', '0', true)
FROM saved

-- name: advisory_untimed_lock
SELECT pg_catalog.{fn}({key})

-- name: advisory_untimed_disarm
SELECT pg_catalog.set_config('lock_timeout',
                             pg_catalog.current_setting('pgcoord.saved_lock_timeout'), true),
       pg_catalog.set_config('statement_timeout',
                             pg_catalog.current_setting('pgcoord.saved_statement_timeout'), true)

-- name: lock_names_record
INSERT INTO pgcoord.lock_names (key, name) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING

-- name: lock_names_record_row
-- lock_names_record for a session's fetchval (a LockHolder's): one row back on
-- every driver (psycopg's fetch of a statement without rows raises).
WITH recorded AS (
    INSERT INTO pgcoord.lock_names (key, name) VALUES ($1, $2) ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT count(*)::integer FROM recorded

-- name: holders_list
SELECT kind, name, key, holder, pid, application_name, client_addr::text AS client_addr,
       granted, since, expires_at, fence, blocked_by, session_alive, member, lane,
       extract(epoch FROM pg_catalog.now() - since)::float8 AS age_seconds,
       extract(epoch FROM expires_at - pg_catalog.now())::float8 AS expires_in_seconds
FROM pgcoord.holders
ORDER BY kind, coalesce(name, key::text), granted DESC, since

-- name: holder_setup
-- Per-session settings of a dedicated session (LockHolder, Elector, Member). The
-- tcp_* settings make the server end this session (releasing its locks) when the
-- client vanishes. The rest keep pgcoord's word whatever the server, the database
-- or the role set (DESIGN "Whatever the DBA sets"): no statement, lock, idle or
-- transaction timeout cuts a doorbell, a watcher or a session lock wait (callers
-- that want a bound set their own after this); transactions are read committed and
-- read-write; names resolve in pg_catalog and pgcoord alone. Only settings this
-- server has are set (transaction_timeout is PostgreSQL 17+).
WITH wanted(name, setting) AS (VALUES
        ('application_name', CAST($1 AS text)), ('tcp_keepalives_idle', CAST($2 AS text)),
        ('tcp_keepalives_interval', CAST($3 AS text)), ('tcp_keepalives_count', '3'),
        ('tcp_user_timeout', CAST($4 AS text)),
        ('statement_timeout', '0'), ('lock_timeout', '0'),
        ('idle_in_transaction_session_timeout', '0'), ('idle_session_timeout', '0'),
        ('transaction_timeout', '0'), ('default_transaction_isolation', 'read committed'),
        ('default_transaction_read_only', 'off'), ('search_path', 'pg_catalog, pgcoord'))
SELECT pg_catalog.pg_backend_pid(),
       (SELECT pg_catalog.count(pg_catalog.set_config(w.name, w.setting, false))
        FROM wanted AS w JOIN pg_catalog.pg_settings AS s ON s.name = w.name)

-- name: holder_reset
-- Undo holder_setup before a borrowed connection goes back to its pool.
RESET application_name; RESET tcp_keepalives_idle; RESET tcp_keepalives_interval;
RESET tcp_keepalives_count; RESET tcp_user_timeout

-- name: holder_backend_pid
SELECT pg_catalog.pg_backend_pid()

-- name: holder_cancel_waits
-- LockHolder.close(): cut short the lock waits of its waiting sessions ($1, their
-- backend pids) before they are closed; only a wait for a lock (a session already
-- granted its lock is closed idle, and ends at once).
SELECT pg_catalog.count(pg_catalog.pg_cancel_backend(a.pid))::integer
FROM pg_catalog.pg_stat_activity AS a
WHERE a.pid = ANY (CAST($1 AS integer[])) AND a.wait_event_type = 'Lock'

-- name: holder_probe
SELECT 1

-- name: holder_undo
-- Release every level of a session lock on {key} that this session holds,
-- without the warning pg_advisory_unlock gives for a lock not held.
DO $pgcoord$ BEGIN
    WHILE EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.pid = pg_catalog.pg_backend_pid() AND l.granted
          AND l.objsubid = 1 AND ((l.classid::bigint << 32) | l.objid::bigint) = {key}
          AND l.mode = '{mode}'
    ) LOOP
        PERFORM pg_catalog.{unlock_fn}({key});
    END LOOP;
END $pgcoord$

-- name: holder_unlock_all
SELECT pg_catalog.pg_advisory_unlock_all()

-- name: holder_advisory_count
-- Advisory locks this session still holds or awaits: 0 means the connection
-- can go back to its pool.
SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks
WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid()

-- name: holder_setup_saving
-- holder_setup for a borrowed connection: also returns what it changes, so the
-- connection can go back exactly as it came (holder_give_back). For each name,
-- its session-level value, or NULL where it had none (set_config with NULL goes
-- back to the connection's default). The MATERIALIZED CTE is read before any
-- set_config of the outer query runs. client_connection_check_interval ($5 ms)
-- makes a backend that waits for a lock notice that its client went away (the
-- wait is dropped then, instead of being granted to a session nobody reads).
WITH wanted(name, setting) AS (VALUES
        ('application_name', CAST($1 AS text)), ('tcp_keepalives_idle', CAST($2 AS text)),
        ('tcp_keepalives_interval', CAST($3 AS text)), ('tcp_keepalives_count', '3'),
        ('tcp_user_timeout', CAST($4 AS text)),
        ('client_connection_check_interval', CAST($5 AS text)),
        ('statement_timeout', '0'), ('lock_timeout', '0'),
        ('idle_in_transaction_session_timeout', '0'), ('idle_session_timeout', '0'),
        ('transaction_timeout', '0'), ('default_transaction_isolation', 'read committed'),
        ('default_transaction_read_only', 'off'), ('search_path', 'pg_catalog, pgcoord')),
previous AS MATERIALIZED (
    SELECT s.name, CASE WHEN s.source = 'session' THEN s.setting END AS setting,
           w.setting AS wanted
    FROM pg_catalog.pg_settings AS s JOIN wanted AS w ON w.name = s.name
)
SELECT pg_catalog.pg_backend_pid(),
       pg_catalog.array_agg(previous.name ORDER BY previous.name),
       pg_catalog.array_agg(previous.setting ORDER BY previous.name),
       pg_catalog.count(pg_catalog.set_config(previous.name, previous.wanted, false)),
       pg_catalog.pg_is_in_recovery()
FROM previous

-- name: server_in_recovery
-- Asked only when the server reported in_hot_standby = on at its last answer: a
-- standby promoted since reports off only after its next statement.
SELECT pg_catalog.pg_is_in_recovery()

-- name: holder_give_back
-- Before a borrowed connection goes back: release every advisory lock of the
-- session, put back the settings holder_setup_saving changed ($1 names, $2
-- values), and count the advisory locks left, which must be 0. One round trip;
-- the FROM subquery (volatile, so never flattened) runs before the counts.
SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.pg_locks
        WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid()) AS advisory_left,
       (SELECT pg_catalog.count(pg_catalog.set_config(s.name, s.setting, false))
        FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[]))
             AS s(name, setting)) AS restored
FROM (SELECT pg_catalog.pg_advisory_unlock_all()) AS released

-- name: holder_unlocks
-- Deferred unlocks of a LockHolder session: $1 exclusive keys, $2 shared keys.
-- The count is of unlocks that found no such lock held (0 when all is well).
SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.unnest($1::bigint[]) AS k
        WHERE NOT pg_catalog.pg_advisory_unlock(k))
     + (SELECT pg_catalog.count(*) FROM pg_catalog.unnest($2::bigint[]) AS k
        WHERE NOT pg_catalog.pg_advisory_unlock_shared(k))

-- name: holder_unlocks_then_try
-- A try for the next lock ({fn} on key $1) after holder_unlocks ($2 exclusive,
-- $3 shared keys), in one round trip. The unlocks run first (a volatile FROM
-- subquery is never flattened, and is read before the outer target list), so
-- another session waiting for a key we release gets it before our own try
-- could take it again.
SELECT pg_catalog.{fn}($1), released.failed
FROM (SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.unnest($2::bigint[]) AS k
              WHERE NOT pg_catalog.pg_advisory_unlock(k))
           + (SELECT pg_catalog.count(*) FROM pg_catalog.unnest($3::bigint[]) AS k
              WHERE NOT pg_catalog.pg_advisory_unlock_shared(k)) AS failed) AS released

-- name: holder_unlock_then_try
-- holder_unlocks_then_try for the usual case, one queued unlock ({unlock_fn} on
-- key $2), with scalar parameters, which cost less to send than arrays. The
-- unlock runs first, as there.
SELECT pg_catalog.{fn}($1), NOT released.ok
FROM (SELECT pg_catalog.{unlock_fn}($2::bigint) AS ok) AS released

-- name: lease_acquire
SELECT fence, expires_at FROM pgcoord.lease_acquire($1, $2, $3, $4)

-- name: lease_may_be_free
-- Whether lease $1 could be taken now for all its row says: held by nobody, or expired.
-- A plain read, where lease_acquire locks the row (a write) and asks pg_locks whether
-- the holder's session lives: a member-bound follower looks with this between news,
-- and asks for the lease only when it may be free (see elector/campaign.py).
SELECT NOT EXISTS (SELECT 1 FROM pgcoord.leases AS l
                   WHERE l.name = $1 AND l.holder IS NOT NULL
                     AND l.expires_at > pg_catalog.clock_timestamp())

-- name: lease_acquire_bounded
-- lease_acquire with a bound of its own ($5, e.g. '200ms') on the row lock it may
-- wait for: ON CONFLICT DO UPDATE waits behind a fenced transaction that holds the row
-- FOR SHARE. Past the bound the lease counts as busy (55P03), whatever lock_timeout
-- the database or role sets. The setting is made in the argument's initplan, for this
-- statement's transaction only, as in lease_release_bounded.
SELECT a.fence, a.expires_at FROM pgcoord.lease_acquire($1, $2, $3, (
    SELECT CAST($4 AS integer) WHERE pg_catalog.set_config('lock_timeout', $5, true) IS NOT NULL
)) AS a

-- name: lease_renew
SELECT expires_at FROM pgcoord.lease_renew($1, $2, $3, $4)

-- name: lease_release
SELECT fence FROM pgcoord.lease_release($1, $2, $3)

-- name: lease_release_bounded
-- lease_release with a server-side bound on its lock wait ($4, e.g. '5000ms'), for
-- this statement's transaction only: a fenced transaction holding the row FOR SHARE
-- must not keep the server waiting after the client gave up. The setting is made in
-- the argument's initplan, which runs before the (non-inlinable) function's UPDATE.
SELECT r.fence FROM pgcoord.lease_release($1, $2, (
    SELECT CAST($3 AS bigint) WHERE pg_catalog.set_config('lock_timeout', $4, true) IS NOT NULL
)) AS r

-- name: lease_check_fence
SELECT pgcoord.check_fence($1, $2)

-- name: lease_current_holder
SELECT holder, fence, expires_at FROM pgcoord.leases
WHERE name = $1 AND holder IS NOT NULL AND expires_at > pg_catalog.clock_timestamp()

-- name: ears_open
-- Before a LISTEN on one of pgcoord's broadcast channels: register this session
-- as a listener, so that the news is told at all (pgcoord.notify_heard, 0010).
SELECT pgcoord.ears_open($1)

-- name: ears_close
-- After the UNLISTEN: this session no longer needs the channel's news.
SELECT pgcoord.ears_close($1)

-- name: elector_interrupt_wait
-- A watch() began while the elector's own session ($1) waits on the doorbell,
-- listening to nothing: cut that wait (only a wait on an advisory lock) so that
-- it LISTENs before waiting again. True when it was cut.
SELECT coalesce(pg_catalog.bool_or(pg_catalog.pg_cancel_backend(a.pid)), false)
FROM pg_catalog.pg_stat_activity AS a
WHERE a.pid = $1 AND a.wait_event_type = 'Lock' AND a.wait_event = 'advisory'

-- name: elector_session
-- The elector's own session: the server ends it after {idle_ms} ms of silence,
-- so a paused or partitioned leader loses its doorbell lock and its lease. A
-- follower whose client went away mid doorbell wait leaves the queue within a
-- second (client_connection_check_interval), not at the wait's lock_timeout (a ttl).
SET idle_session_timeout = {idle_ms}; SET client_connection_check_interval = 1000

-- name: job_register
SELECT registered_at, now FROM pgcoord.job_register($1, $2, $3)

-- name: job_state
-- The database clock and, per job, its latest scheduled slot: one round trip a tick.
-- CAST, not $1::text[]: SQLAlchemy's text() reads ":p1::" as no parameter at all.
SELECT pg_catalog.clock_timestamp(),
       pg_catalog.array_agg(m.last ORDER BY u.ord)
FROM pg_catalog.unnest(CAST($1 AS text[])) WITH ORDINALITY AS u(job, ord)
CROSS JOIN LATERAL (
    SELECT pg_catalog.max(s.slot_at) AS last FROM pgcoord.job_slots AS s WHERE s.job = u.job AND NOT s.manual
) AS m

-- name: job_claim
SELECT state, attempt FROM pgcoord.job_claim($1, $2, $3, $4, $5, false)

-- name: job_claim_now
SELECT c.state, c.attempt, n.slot
FROM (SELECT pg_catalog.clock_timestamp() AS slot) AS n
CROSS JOIN LATERAL pgcoord.job_claim($1, n.slot, $2, $3, $4, true) AS c

-- name: job_heartbeat
SELECT pgcoord.job_heartbeat($1, $2, $3, $4, $5)

-- name: job_finish
SELECT pgcoord.job_finish($1, $2, $3, $4, $5, $6, $7)

-- name: job_mark_missed
SELECT pgcoord.job_mark_missed($1, $2, $3)

-- name: job_recover
SELECT slot_at, attempt FROM pgcoord.job_recover($1, $2, $3, $4, $5)

-- name: job_prune
SELECT pgcoord.job_prune($1, $2, $3)

-- name: semaphore_take
-- pgcoord.semaphore()'s acquire, sent after BEGIN in the same message; {key} and
-- {limit} are integers validated in Python. Raises PC001 when every lane is taken.
-- No NOTIFY is queued: pgcoord wakes waiters after the commit (semaphore_wake).
SELECT pgcoord.semaphore_take_xact({key}, {limit}, NULL, false)

-- name: semaphore_take_call
SELECT pgcoord.semaphore_take_xact($1, $2, NULL, false)

-- name: semaphore_take_joined
-- In the caller's own transaction, which may already hold lanes of this
-- semaphore: those are not taken twice (a lock is re-entrant per session). The
-- release's NOTIFY is queued for the caller's commit, which pgcoord does not see.
SELECT pgcoord.semaphore_take_xact({key}, {limit}, pgcoord.semaphore_own_lanes({key}), true)

-- name: semaphore_adopt
-- The lane a waiter got at session level becomes this transaction's, after BEGIN.
SELECT pgcoord.semaphore_adopt_xact({key}, {lane})

-- name: semaphore_wait_try
SELECT pgcoord.semaphore_wait_try($1, $2, $3, CAST($4 AS integer[]))

-- name: semaphore_wait_abandon
SELECT pgcoord.semaphore_wait_abandon($1)

-- name: semaphore_try_session
-- holder.semaphore() on a connection that may already hold lanes ($3, known to
-- the holder): a lane at session level, or NULL.
SELECT pgcoord.semaphore_try($1, $2, true, CAST($3 AS integer[]))

-- name: semaphore_own_lanes
-- The lanes of $1 this session holds (a member's session, swept after a try
-- that got no answer in time).
SELECT pgcoord.semaphore_own_lanes($1)

-- name: semaphore_release
SELECT pgcoord.semaphore_release($1, $2)

-- name: semaphore_wake
-- After the commit or rollback that freed a lane: a NOTIFY if anyone waits.
SELECT pgcoord.semaphore_wake($1)

-- name: semaphore_record
-- The registry that lets pgcoord.holders name lanes: once per process and name.
INSERT INTO pgcoord.semaphores (name, key, "limit") VALUES ($1, $2, $3)
ON CONFLICT (name) DO UPDATE SET key = excluded.key, "limit" = excluded."limit",
    updated_at = pg_catalog.clock_timestamp()
WHERE (pgcoord.semaphores.key, pgcoord.semaphores."limit") IS DISTINCT FROM (excluded.key, excluded."limit")
