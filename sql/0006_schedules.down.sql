-- Reverses 0006.
DROP FUNCTION pgcoord.schedule_finish(text[], timestamptz[], text[], integer[], text[], text[], text[]);
DROP FUNCTION pgcoord.schedule_take_owed(text[], timestamptz[], boolean[], bigint[], text);
DROP FUNCTION pgcoord.schedule_prune(text[], bigint[], integer);
DROP FUNCTION pgcoord.schedule_recover(text[], bigint[], boolean[], integer[], text);
DROP FUNCTION pgcoord.schedule_decide(text[], timestamptz[], bigint[], text[], text[], text[], bigint[], text);
DROP FUNCTION pgcoord.schedule_declare(jsonb);
DROP FUNCTION pgcoord.schedule_update(text, jsonb, bigint, timestamptz, timestamptz[]);
DROP FUNCTION pgcoord.schedule_add(text, text, text, text, jsonb, jsonb);
DROP FUNCTION pgcoord.schedule_trigger(text);
DROP FUNCTION pgcoord.schedule_remove(text);
DROP FUNCTION pgcoord.schedule_resume(text, text);
DROP FUNCTION pgcoord.schedule_pause(text);
DROP TABLE pgcoord.schedule_owed;
DROP TABLE pgcoord.schedules;
DROP FUNCTION pgcoord.schedules_changed();
DROP FUNCTION pgcoord.schedules_versioned();
DROP FUNCTION pgcoord.schedule_owed_added();
DROP TABLE pgcoord.schedule_epoch;
