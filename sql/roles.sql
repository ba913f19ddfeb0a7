-- Least-privilege roles for pgcoord. Create the roles first, then run this as
-- the owner of schema pgcoord (the role that ran `pgcoord migrate`):
--
--   CREATE ROLE pgcoord_service LOGIN;    -- your services
--   CREATE ROLE pgcoord_operator LOGIN;   -- people and dashboards that look
--
-- Checked by tests/integration/test_operators.py::test_least_privilege_roles.

-- Services: take locks and leases, run jobs. No DDL, no ownership.
GRANT USAGE ON SCHEMA pgcoord TO pgcoord_service;
GRANT SELECT, INSERT ON pgcoord.lock_names TO pgcoord_service;
GRANT SELECT, INSERT, UPDATE ON pgcoord.leases TO pgcoord_service;
-- The history of leadership (pgcoord.lease_terms, migration 0009) is written by
-- triggers on pgcoord.leases that run as the schema's owner: no grant needed.
GRANT SELECT, INSERT, UPDATE ON pgcoord.jobs TO pgcoord_service;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.job_slots TO pgcoord_service;
GRANT SELECT ON pgcoord.holders TO pgcoord_service;
-- Members: join (a row and an id), heartbeat, leave, and mark dead peers gone.
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.member_sessions TO pgcoord_service;
GRANT USAGE ON SEQUENCE pgcoord.member_ids TO pgcoord_service;
GRANT SELECT ON pgcoord.members TO pgcoord_service;
-- Semaphores: name their lanes for the view (pgcoord.semaphores, best effort).
GRANT SELECT, INSERT, UPDATE ON pgcoord.semaphores TO pgcoord_service;
-- check_fence() locks the lease row FOR SHARE, which needs UPDATE (granted above).
-- Schedules at runtime: add, change, pause and remove them; the triggers bump the
-- change counter; runs owed (trigger, resume) are taken by the replica that runs them.
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.schedules TO pgcoord_service;
-- schedule_take_owed deletes the rows it takes FOR UPDATE SKIP LOCKED, which needs UPDATE.
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.schedule_owed TO pgcoord_service;
GRANT SELECT, UPDATE ON pgcoord.schedule_epoch TO pgcoord_service;
-- Pausing and resuming keep the history of pauses (a trigger, as the caller).
GRANT SELECT, INSERT, UPDATE, DELETE ON pgcoord.schedule_pauses TO pgcoord_service;

-- Operators: read who holds what, nothing else. pg_read_all_stats lets them see
-- other roles' application_name and client_addr in the view.
GRANT USAGE ON SCHEMA pgcoord TO pgcoord_operator;
GRANT SELECT ON pgcoord.holders TO pgcoord_operator;
GRANT SELECT ON pgcoord.members TO pgcoord_operator;
-- The history of leadership, and every election, vacant ones too (the dashboard's /elections).
GRANT SELECT ON pgcoord.leases TO pgcoord_operator;
GRANT SELECT ON pgcoord.lease_terms, pgcoord.lease_history TO pgcoord_operator;
-- `pgcoord jobs` and `pgcoord jobs history` read these; pause/resume/trigger need the service role.
GRANT SELECT ON pgcoord.schedules, pgcoord.job_slots TO pgcoord_operator;
GRANT pg_read_all_stats TO pgcoord_operator;
