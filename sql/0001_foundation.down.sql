-- Reverses 0001. The schema itself is dropped by the migration environment
-- once its version table is gone too.
DROP VIEW IF EXISTS pgcoord.holders;
DROP TABLE IF EXISTS pgcoord.lock_names;
DROP FUNCTION IF EXISTS pgcoord.lock_key(text);
