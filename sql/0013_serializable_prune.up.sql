-- pgcoord 0013: in a serializable transaction the leadership record prunes every
-- 128th fence, not every 8th. Executed verbatim by
-- migrations/versions/0013_serializable_prune.py.
-- Avoid percent signs and colon-prefixed words: drivers treat them as placeholders.
--
-- Under default_transaction_isolation = serializable, takeovers of different names
-- whose prunes met on one index page of pgcoord.lease_terms failed one of them with
-- 40001: 13 of 1,500 takeovers of 6 names in a CI run on 2 loaded cores, where 0009
-- had measured about 1 in 10,000 on a quiet machine
-- (tests/integration/test_lease_terms_attacks.py). Two prunes must meet for a
-- conflict, so pruning 16 times less often makes it about 256 times rarer; a name
-- then holds at most kept + 127 terms while only serializable transactions take it.
-- A takeover at another isolation level prunes it back to kept + 7.

CREATE OR REPLACE FUNCTION pgcoord.lease_terms_record()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pgcoord', 'pg_temp'
AS $function$
DECLARE
    now_ timestamptz := pg_catalog.clock_timestamp();
    -- lease_terms_kept(), read here rather than called: a SQL function with a SET
    -- clause is planned again at every call, which a takeover would pay for.
    kept_setting text := pg_catalog.current_setting('pgcoord.lease_terms_kept', true);
    kept integer := 50;
    end_fence bigint;     -- the term that ends here, if any
    how text;
    ended timestamptz;
    resign timestamptz;
BEGIN
    IF kept_setting ~ '^ *[0-9]{1,9} *$' THEN
        kept := kept_setting::integer;
    END IF;
    IF kept <= 0 THEN
        RETURN NULL;
    END IF;
    IF TG_OP = 'UPDATE' AND OLD.holder IS NOT NULL THEN
        IF NEW.fence = OLD.fence AND NEW.holder IS NOT DISTINCT FROM OLD.holder THEN
            -- The same term, tied to a session now (lease_bind_session).
            INSERT INTO pgcoord.lease_terms AS t (name, fence, holder, holder_pid, started_at)
            VALUES (NEW.name, NEW.fence, NEW.holder, NEW.holder_pid, coalesce(NEW.acquired_at, now_))
            ON CONFLICT (name, fence) DO UPDATE SET holder_pid = excluded.holder_pid;
            RETURN NULL;
        END IF;
        end_fence := OLD.fence;
        resign := OLD.resign_requested_at;
        IF OLD.expires_at <= now_ THEN
            how := 'expired';
            ended := OLD.expires_at;
        ELSIF NEW.fence = OLD.fence THEN
            how := 'released';
            ended := now_;
        -- Gone: of this server incarnation (another one's sessions cannot be looked
        -- up, and count as alive), and either no such backend at all (cheap: the
        -- backend status array, not the lock table) or one without the doorbell.
        ELSIF OLD.holder_pid IS NOT NULL
              AND (OLD.holder_server IS NULL OR OLD.holder_server = pgcoord.server_incarnation())
              AND (NOT EXISTS (SELECT 1 FROM pg_catalog.pg_stat_get_activity(OLD.holder_pid))
                   OR NOT pgcoord.lease_session_alive(OLD.name, OLD.holder_pid, OLD.holder_server)) THEN
            how := 'session_ended';
        ELSE
            how := 'taken_over';
        END IF;
        IF ended IS NULL THEN
            -- Ended by the takeover itself: when the new term began.
            ended := LEAST(NEW.acquired_at, now_);
        END IF;
    END IF;
    IF NEW.holder IS NOT NULL AND (TG_OP = 'INSERT' OR NEW.fence IS DISTINCT FROM OLD.fence) THEN
        -- Simple statements, each planned once per session (plpgsql's generic
        -- plans): one statement of data-modifying CTEs would be planned again at
        -- every call, its cost depending on whether this call prunes.
        -- Upserts, not UPDATEs, for the term that ends (and the bind above): under
        -- default_transaction_isolation = serializable an UPDATE's index scan takes
        -- predicate locks on the primary key's pages, and two takeovers of
        -- different names writing to one page then failed one of them with 40001;
        -- an upsert's conflict check takes none. (The prune reads, but only one
        -- takeover in 8 prunes, and two must meet for a conflict.) A term missing
        -- from the record (it started while the record was off) is recorded ended.
        IF end_fence IS NOT NULL THEN
            INSERT INTO pgcoord.lease_terms AS t
                (name, fence, holder, holder_pid, started_at, ended_at, ended_how, resign_requested_at)
            VALUES (NEW.name, end_fence, OLD.holder, OLD.holder_pid, coalesce(OLD.acquired_at, ended),
                    ended, how, resign)
            ON CONFLICT (name, fence) DO UPDATE
                SET ended_at = excluded.ended_at, ended_how = excluded.ended_how,
                    resign_requested_at = excluded.resign_requested_at
                WHERE t.ended_at IS NULL;
        END IF;
        -- A fence is reused only when the row was deleted and made again: the new
        -- term replaces the forgotten one.
        INSERT INTO pgcoord.lease_terms AS t (name, fence, holder, holder_pid, started_at)
        VALUES (NEW.name, NEW.fence, NEW.holder, NEW.holder_pid, coalesce(NEW.acquired_at, now_))
        ON CONFLICT (name, fence) DO UPDATE
            SET holder = excluded.holder, holder_pid = excluded.holder_pid,
                started_at = excluded.started_at, ended_at = NULL, ended_how = NULL,
                resign_requested_at = NULL;
        -- Retention: the last `kept` fences of this name (fences grow by one per
        -- term), pruned every 8th fence, 8 terms at a time (an index range on the
        -- primary key), so a name holds at most kept + 7 terms. In a serializable
        -- transaction (a caller's, or a Lease's on a pool under a serializable
        -- default) only every 128th fence, so at most kept + 127: the range takes predicate locks
        -- on the index pages it reads, and two prunes of different names that meet
        -- on one page fail one of the takeovers (40001). Two prunes meet in
        -- proportion to the square of how often they run.
        IF pg_catalog.mod(NEW.fence, 8) = 0
           AND (pg_catalog.mod(NEW.fence, 128) = 0
                OR pg_catalog.current_setting('transaction_isolation') <> 'serializable') THEN
            DELETE FROM pgcoord.lease_terms AS t
             WHERE t.name = NEW.name AND t.fence <= NEW.fence - kept;
        END IF;
    ELSIF end_fence IS NOT NULL THEN
        INSERT INTO pgcoord.lease_terms AS t
            (name, fence, holder, holder_pid, started_at, ended_at, ended_how, resign_requested_at)
        VALUES (NEW.name, end_fence, OLD.holder, OLD.holder_pid, coalesce(OLD.acquired_at, ended),
                ended, how, resign)
        ON CONFLICT (name, fence) DO UPDATE
            SET ended_at = excluded.ended_at, ended_how = excluded.ended_how,
                resign_requested_at = excluded.resign_requested_at
            WHERE t.ended_at IS NULL;
    END IF;
    RETURN NULL;
END
$function$;
