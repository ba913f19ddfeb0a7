-- pgcoord 0011 down: members beat with member_heartbeat (0004) again, and a watcher
-- reaps in a statement of its own after its wait.
DROP FUNCTION pgcoord.member_wait_reap(integer);
DROP FUNCTION pgcoord.schedule_tick_read();
DROP FUNCTION pgcoord.member_join_from(text, text, jsonb, integer, text, boolean, text);
ALTER TABLE pgcoord.member_sessions DROP COLUMN client;
DROP FUNCTION pgcoord.member_beat(integer, boolean);
