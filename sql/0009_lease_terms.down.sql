-- pgcoord 0009 down: no history of leadership.
DROP VIEW pgcoord.lease_history;
DROP TRIGGER lease_terms_forgotten ON pgcoord.leases;
DROP TRIGGER lease_terms_changed ON pgcoord.leases;
DROP TRIGGER lease_terms_started ON pgcoord.leases;
DROP FUNCTION pgcoord.lease_terms_forget();
DROP FUNCTION pgcoord.lease_terms_record();
DROP FUNCTION pgcoord.lease_terms_kept();
DROP TABLE pgcoord.lease_terms;
