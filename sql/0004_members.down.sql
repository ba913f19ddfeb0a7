-- Reverses 0004.
DROP FUNCTION pgcoord.member_heartbeat(integer);
DROP FUNCTION pgcoord.member_reap(integer);
DROP FUNCTION pgcoord.member_leave(integer);
DROP FUNCTION pgcoord.member_join(text, text, jsonb, integer, text, boolean);
DROP FUNCTION pgcoord.member_reap_group(text);
DROP FUNCTION pgcoord.member_mark_gone(integer, text);
DROP FUNCTION pgcoord.member_notify(text, text, integer, text);
DROP FUNCTION pgcoord.member_left_reason(timestamptz, integer);
DROP VIEW pgcoord.members;
DROP FUNCTION pgcoord.member_sessions_alive();
DROP FUNCTION pgcoord.member_alive_ns();
DROP TABLE pgcoord.member_sessions;
DROP SEQUENCE pgcoord.member_ids;
