-- pgcoord 0011 down: members beat with member_heartbeat (0004) again.
DROP FUNCTION pgcoord.member_beat(integer, boolean);
